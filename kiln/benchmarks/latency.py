"""Per-step decode latency of LLMEngine.step at fixed batch sizes, for several compilation
configs in one process, with speedups vs the first; on CPU the engines take turns on each batch.
"""
from kiln.benchmarks.decode_steps import (
    STEPS_PER_TURN,
    measure_batch,
    start_batch,
    summarize_ms,
    time_steps,
    turn_lengths,
)
from kiln.benchmarks.engine_probe import engine_model
from kiln.benchmarks.latency_subject import Subject, start_subject
from kiln.benchmarks.linear_floor import LinearFloor, above_floor, speedup_ceiling
from kiln.config.compilation_config import spec_to_dict
from kiln.engine.arg_utils import EngineArgs
from kiln.pooling.pooling_inputs import refuse_pooling_bench

DEFAULT_COMPARE = ["0", "3"]


def merge_spec(base, spec) -> dict:
    """A --compare item on top of the engine's -O: the item's fields win."""
    return {**spec_to_dict(base), **spec_to_dict(spec)}


def run_one_after_another(configs: list[tuple[str, dict]], plan: dict,
                          engine_args: EngineArgs) -> tuple[list[Subject], None]:
    """One engine at a time (what fits on one GPU): build, every batch size, free. No linear
    floor: on a GPU, kernels launched one by one are no floor for a replayed graph."""
    done = []
    for label, spec in configs:
        subject = start_subject(label, spec, engine_args, **plan)
        try:
            for b in plan["batch_sizes"]:
                subject.record(b, measure_batch(
                    subject.engine, subject.prompts(b, plan["input_len"]), plan["num_steps"],
                    plan["warmup_steps"], subject.max_tokens(plan["input_len"]),
                    f"latency-b{b}"))
        finally:
            subject.engine.shutdown()
        done.append(subject)
    return done, None


def run_interleaved(configs: list[tuple[str, dict]], plan: dict,
                    engine_args: EngineArgs) -> tuple[list[Subject], dict | None]:
    """Every engine alive at once, taking turns of STEPS_PER_TURN timed steps on the same batch,
    so a host whose speed drifts (a shared CPU) slows every config alike. On CPU the linear
    floor (linear_floor.py) takes its turns too; returns the subjects and the floor's figures."""
    subjects: list[Subject] = []
    floor, floor_results = None, {}
    try:
        for label, spec in configs:
            subjects.append(start_subject(label, spec, engine_args, **plan))
        model = engine_model(subjects[0].engine)
        if subjects[0].kiln_config.device_config.device == "cpu" and model is not None:
            floor = LinearFloor(model)
        for b in plan["batch_sizes"]:
            tag, started = f"latency-b{b}", []
            try:
                for s in subjects:
                    started.append((s, start_batch(
                        s.engine, s.prompts(b, plan["input_len"]), plan["warmup_steps"],
                        s.max_tokens(plan["input_len"]), tag)))
                times: list[list[float]] = [[] for _ in subjects]
                floor_times: list[float] = []
                if floor is not None:
                    floor.run(b)  # its inputs made and its kernels warm before timing
                for turn in turn_lengths(plan["num_steps"]):
                    for s, own in zip(subjects, times):
                        own += time_steps(s.engine, turn, b, tag)
                    if floor is not None:
                        floor_times += floor.time(b, turn)
            finally:
                for s, ids in started:
                    s.engine.abort_request(ids)
            for s, own in zip(subjects, times):
                s.record(b, own)
            if floor is not None:
                floor_results[str(b)] = summarize_ms(floor_times)
    finally:
        for s in subjects:
            s.engine.shutdown()
    return subjects, (floor_results if floor is not None else None)


def speedups(first: dict, other: dict) -> dict:
    """first's median over other's, per batch size (> 1: other is faster)."""
    return {b: first[b]["median_ms"] / other[b]["median_ms"] for b in first}


def default_interleave(engine_args: EngineArgs) -> bool:
    """Interleave where engines fit side by side: on CPU (host memory); on a GPU each engine
    would size its KV cache from the same free memory."""
    from kiln.config.device_config import resolve_device

    return resolve_device(engine_args.device) == "cpu"


def run_latency(engine_args: EngineArgs, batch_sizes: list[int], input_len: int, num_steps: int,
                compare: list[str] | None = None, warmup_steps: int = 3,
                interleave: bool | None = None) -> dict:
    """Benchmark; returns the one-line JSON report as a dict. interleave None: on CPU only."""
    compare = list(compare or DEFAULT_COMPARE)
    if engine_args.enforce_eager:
        raise ValueError("--enforce-eager forces mode 0 on every --compare config; drop it and "
                         "list the configs in --compare")
    specs = [merge_spec(engine_args.compilation_config, item) for item in compare]  # checks all
    refuse_pooling_bench(engine_args.create_kiln_config().model_config, "kiln bench latency")
    if interleave is None:
        interleave = default_interleave(engine_args)
    plan = {"batch_sizes": batch_sizes, "input_len": input_len, "num_steps": num_steps,
            "warmup_steps": warmup_steps}
    runner = run_interleaved if interleave else run_one_after_another
    subjects, floor = runner(list(zip(compare, specs)), plan, engine_args)
    configs = [s.report() for s in subjects]
    first = configs[0]["results"]
    for c in configs:
        c["speedup_vs_first"] = speedups(first, c["results"])
        if floor is not None:
            c["above_linear_floor_ms"] = above_floor(c["results"], floor)
    import torch

    head = configs[0]
    return {"benchmark": "latency", "model": head["model"], "dtype": head["dtype"],
            "device": head["device"], "num_threads": torch.get_num_threads(),
            "interleaved": interleave, "steps_per_turn": STEPS_PER_TURN if interleave else None,
            "batch_sizes": batch_sizes, "input_len": input_len,
            "num_steps": num_steps, "warmup_steps": warmup_steps,
            "model_weight_bytes": head["model_weight_bytes"],
            # The linear layers and LM head alone (see linear_floor.py); null off CPU.
            "linear_floor": floor,
            "speedup_ceiling_vs_first": None if floor is None else speedup_ceiling(first, floor),
            "configs": configs}
