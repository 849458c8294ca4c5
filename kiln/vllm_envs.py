"""vLLM's environment variables that Kiln does not honour, named once at start-up.

A deployment moved from vLLM keeps its environment: the variables Kiln has an equivalent for
are read as that (kiln/envs.py, VLLM_NAMES); any other VLLM_* set to a value that would change
vLLM's behaviour is named here, with what to use instead, rather than ignored in silence.
"""
from kiln import envs

# vLLM's variable -> (its values that change nothing here, what Kiln does or offers instead);
# for one that is also in envs.VLLM_NAMES, what of it Kiln does not honour.
UNHONOURED: dict[str, tuple[tuple[str, ...], str]] = {
    "VLLM_USE_V1": (("1", "true"), "Kiln has only vLLM's V1 engine"),
    "VLLM_CACHE_ROOT": ((), "Kiln caches under KILN_CACHE_ROOT (default ~/.cache/kiln)"),
    "VLLM_WORKER_MULTIPROC_METHOD": (
        ("spawn",), "Kiln always spawns its rank processes"),
    "VLLM_SERVER_DEV_MODE": (  # read as KILN_SERVER_DEV_MODE: only part of it is served
        ("0", "false"), "kiln serve adds POST /reset_prefix_cache, /sleep, /wake_up, "
        "/collective_rpc and GET /is_sleeping, not vLLM's /pause, /resume or weight-transfer "
        "routes (/init_weight_transfer_engine, /update_weights, ...)"),
    "VLLM_HOST_IP": ((), "ranks on one machine meet on 127.0.0.1; Ray ranks on the addresses "
                     "Ray gives them"),
    "VLLM_PORT": ((), "Kiln picks a free port for its ranks; kiln serve listens on --port"),
    "VLLM_ENGINE_ITERATION_TIMEOUT_S": (
        (), "a multi-rank step times out after KILN_EXECUTE_MODEL_TIMEOUT_SECONDS"),
    "VLLM_RPC_TIMEOUT": ((), "Kiln's front end has no RPC timeout to set"),
    "VLLM_ATTENTION_BACKEND": ((), "use KILN_ATTENTION_BACKEND (torch | cpu)"),
    "VLLM_LOGGING_CONFIG_PATH": (
        (), "set KILN_CONFIGURE_LOGGING=0 and configure the `kiln` logger yourself"),
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": (
        ("0", "false"), "kiln serve stops when its engine dies"),
    "VLLM_USE_MODELSCOPE": (("0", "false"), "Kiln loads from the Hugging Face hub or a path"),
    "VLLM_PP_LAYER_PARTITION": ((), "Kiln splits layers evenly across pipeline stages"),
    "VLLM_CPU_SGL_KERNEL": (("0", "false"), "Kiln's CPU kernels are its own (KILN_NATIVE_CPU_OPS)"),
    "VLLM_CPU_MOE_PREPACK": (("1", "true"), "Kiln has no IPEX MoE layer"),
    "VLLM_TORCH_PROFILER_DIR": ((), "Kiln has no profiler endpoints"),
}

# Set by vLLM's own deployments without changing what an engine computes or serves.
_NO_EFFECT = frozenset({
    "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_USAGE_SOURCE", "VLLM_USAGE_STATS_SERVER",
    "VLLM_NO_DEPRECATION_WARNING", "VLLM_TARGET_DEVICE", "VLLM_CONFIG_ROOT", "VLLM_RPC_BASE_PATH",
    "VLLM_ASSETS_CACHE", "VLLM_USE_PRECOMPILED"})


_SECRET = frozenset({"VLLM_API_KEY"})


def unhonoured_vllm_settings(environ) -> list[str]:
    """One line per VLLM_* variable in `environ` that is set, would change vLLM's behaviour,
    and is not honoured here; each names what Kiln uses instead. Pure (tested as such)."""
    lines, unknown = [], []
    for name in sorted(environ):
        value = environ[name]
        if not name.startswith("VLLM_") or not value.strip() or name in _NO_EFFECT:
            continue
        harmless, instead = UNHONOURED.get(name, ((), ""))
        if name in envs.VLLM_NAMES.values():
            kiln_name = next(k for k, v in envs.VLLM_NAMES.items() if v == name)
            if (environ.get(kiln_name) or "").strip() and environ[kiln_name] != value:
                if name in _SECRET:  # a log line must not carry the keys
                    lines.append(f"{name} is overridden by {kiln_name}")
                else:
                    lines.append(f"{name}={value!r} is overridden by {kiln_name}="
                                 f"{environ[kiln_name]!r}")
            elif instead and value.strip().lower() not in harmless:
                lines.append(f"{name}={value!r} is honoured in part: {instead}")
            continue
        if name in UNHONOURED:
            if value.strip().lower() not in harmless:
                lines.append(f"{name}={value!r} is not honoured: {instead}")
            continue
        unknown.append(name)
    if unknown:
        lines.append(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} vLLM "
                     "setting(s) Kiln does not read")
    return lines


_warned = False


def warn_unhonoured_once(environ) -> None:
    """Log unhonoured_vllm_settings(environ), the first time an engine starts in this process."""
    global _warned
    if _warned:
        return
    _warned = True
    from kiln.logger import init_logger

    logger = init_logger(__name__)
    for line in unhonoured_vllm_settings(environ):
        logger.warning("%s", line)
