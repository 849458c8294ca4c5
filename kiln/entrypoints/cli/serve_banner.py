"""`kiln serve`'s start-up line: the model served, its dtype, compile mode, KV cache, length,
the engine's threads and cores, and the address and whether it needs an API key."""


def _threads(llm) -> str:
    """The core's threads, and the cores left to this process (KILN_CPU_NUM_OF_RESERVED_CPU)."""
    from kiln.engine.frontend_lanes import usable_cores

    threads = llm.num_threads
    if not threads:
        return ""
    dp = llm.kiln_config.parallel_config.data_parallel_size
    cores, used = usable_cores(), threads * dp  # each data-parallel replica has its own
    left = f", {cores - used} core(s) left to the front end" if cores > used else ""
    return f"engine threads {threads}{' per replica' if dp > 1 else ''}{left} | "


def _replicas(llm) -> str:
    dp = llm.kiln_config.parallel_config.data_parallel_size
    return f" in each of {dp} data-parallel replicas" if dp > 1 else ""


def banner(llm, settings) -> str:
    """One line: what is served, how, where, and whether it needs a key (`llm`: the started
    AsyncLLM, whose core sized the KV cache)."""
    from kiln.model.loader.default_model import model_display_name

    kiln_config = llm.kiln_config
    model = kiln_config.model_config
    cache = kiln_config.cache_config
    mode = kiln_config.compilation_config.mode
    name = (settings.served_model_names or [model_display_name(str(model.model))])[0]
    dtype = str(model.torch_dtype).removeprefix("torch.")
    return (f"kiln serve: model {name} | dtype {dtype} | compile mode {int(mode)} "
            f"({getattr(mode, 'name', mode)}) | KV cache {llm.num_blocks} blocks x "
            f"{cache.block_size} tokens{_replicas(llm)} | max_model_len {llm.max_model_len} | "
            f"{_threads(llm)}"
            f"{'https' if settings.ssl_certfile else 'http'}://{settings.host}:{settings.port}"
            f"{settings.root_path} | API key "
            f"{'on' if settings.api_key else 'off'}")
