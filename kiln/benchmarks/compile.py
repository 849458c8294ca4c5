"""Compile start-up, measured: run everything the engine does before serving and report it
(`kiln compile`), and cold vs warm start-up, each in its own process (`kiln bench compile`).
"""
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kiln import envs
from kiln.benchmarks.child import run_json_child
from kiln.compilation import monitor
from kiln.config import CompilationMode
from kiln.config.compilation_config import spec_to_dict
from kiln.engine.arg_utils import EngineArgs
from kiln.logger import init_logger

logger = init_logger(__name__)

# Flags the `kiln compile` child of `kiln bench compile` is started with, besides engine flags.
CHILD_COMMAND = [sys.executable, "-m", "kiln.entrypoints.cli.main", "compile", "--json"]


# ---- one start-up, in this process ----------------------------------------------------------

def _timed_executor_class(base: type, timings: dict) -> type:
    """`base` with each pre-serving stage timed into `timings`."""

    class TimedExecutor(base):
        def __init__(self, kiln_config):
            start = time.perf_counter()
            super().__init__(kiln_config)
            timings["load_model_s"] = time.perf_counter() - start

        def determine_num_blocks(self) -> int:
            # On CUDA this includes the profiling forward, which is the first call: it compiles.
            start = time.perf_counter()
            try:
                return super().determine_num_blocks()
            finally:
                timings["profile_kv_cache_s"] = time.perf_counter() - start

        def compile_or_warm_up_model(self) -> None:
            start = time.perf_counter()
            try:
                super().compile_or_warm_up_model()
            finally:
                timings["warmup_s"] = time.perf_counter() - start

    return TimedExecutor


def _ops_in_use(kiln_config) -> list[str]:
    """The IR ops the model can call: the int8, fp8 and GGUF ops only under their quantization
    or load format, all_reduce only across tensor-parallel ranks, lora_add only with
    --enable-lora, Gemma's / OLMo-2's ops only for them and not the Llama ops theirs replace (the
    text report listed the int8 ops of a float model)."""
    from kiln.model.registry import ir_ops_not_called

    mc = kiln_config.model_config
    not_called = ir_ops_not_called(mc.architecture)  # another family's norms / activation
    kinds = {"int8": mc.quant_kind == "int8", "fp8": mc.quant_kind == "fp8",
             "int4": mc.quant_kind == "int4",
             "gguf": mc.load_format == "gguf",
             "all_reduce": kiln_config.parallel_config.tensor_parallel_size > 1,
             "lora": kiln_config.lora_config is not None}
    return [op for op in kiln_config.ir_selection.as_dict()
            if op not in not_called and all(on for kind, on in kinds.items() if kind in op)]


def _compile_fields(state: dict) -> dict:
    """The report's compile fields from one process's compile state."""
    d = state["counters"]
    return {
        # per piece compiled cold: {"shape": .., "matches": {pass: rewrites}}
        "pass_runs": state["pass_runs"],
        "pieces": {"total": d["num_piecewise_graphs_seen"],
                   "compiled": d["num_piecewise_capturable_graphs_seen"],
                   # Traced by Dynamo (cold) or loaded from the saved graph (warm).
                   "graphs": d["num_graphs_seen"] + d["num_saved_graph_loads"]},
        "per_shape": monitor.per_shape(state["events"]),
        "events": state["events"],
        "cache": {"enabled": not envs.disable_compile_cache(), "dirs": state["cache_dirs"],
                  "key_dirs": sorted({str(Path(p).parents[1]) for p in state["cache_dirs"]}),
                  "inductor_cache_dir": state["inductor_cache_dir"],
                  "hits": d["num_cache_hits"], "misses": d["num_cache_misses"],
                  "corrupt": d["num_corrupt_artifacts"]},
        "inductor": {"compiles": d["num_inductor_compiles"],
                     "artifacts_loaded": d["num_compiled_artifacts_loaded"],
                     "artifacts_saved": d["num_compiled_artifacts_saved"]},
        "counters": d,
    }


def _times(state: dict) -> dict:
    return {k: state[k] for k in ("trace_s", "compile_s", "load_s")}


def _draft_report(kiln_config, state: dict | None) -> dict:
    """{"draft": ...}: a speculative draft model's or EAGLE head's own compile (rank 0's),
    which runs in the target's process but is not the target's; {} without one."""
    from kiln.spec_decode.draft_model_proposer import draft_kiln_config

    spec = kiln_config.speculative_config
    if spec is None or not spec.runner_proposes:
        return {}
    draft = draft_kiln_config(kiln_config)
    dc, cc = draft.model_config, draft.compilation_config
    mode = CompilationMode(cc.mode)
    if state is None:  # it ran eagerly: nothing of the compile stack's is its
        state = monitor.state_since(monitor.process_compile_state(),
                                    monitor.process_compile_state())
    return {"draft": {"model": dc.model, "method": spec.method,
                      "architecture": dc.architecture, "num_layers": dc.num_layers,
                      "compilation_mode": int(mode), "compilation_mode_name": mode.name,
                      "splitting_ops": list(cc.splitting_ops),
                      "shapes": {"range": [1, draft.scheduler_config.max_num_batched_tokens],
                                 "compile_sizes": list(cc.compile_sizes)},
                      **_compile_fields(state), "times": _times(state)}}


def compile_report(engine_args: EngineArgs) -> dict:
    """Build the engine's config, load the model, size the KV cache, compile and warm up every
    shape (all the engine does before serving), and report what the compile stack did. With
    several ranks each compiles in its own process: the report is rank 0's, and "ranks" holds
    every rank's (the stages of a pipeline compile different layers)."""
    from kiln.core.engine_core import EngineCore
    from kiln.engine.llm_engine import get_executor_class

    start = time.perf_counter()
    kiln_config = engine_args.create_kiln_config()
    config_s = time.perf_counter() - start
    before = monitor.process_compile_state()
    timings: dict[str, float] = {}
    executor_class = _timed_executor_class(get_executor_class(kiln_config.parallel_config),
                                           timings)
    core = EngineCore(kiln_config, executor_class)
    total_s = time.perf_counter() - start
    try:
        mc, cc = kiln_config.model_config, kiln_config.compilation_config
        # a rank process is started for this engine: all its compile state is this start-up's
        rank_states = core.executor.compile_stats()
        # (the target's part, the draft's part or None) for each rank
        parts = ([monitor.split_section(st, None, "draft") for st in rank_states] if rank_states
                 else [monitor.split_section(monitor.process_compile_state(), before, "draft")])
        ranks = [{"rank": st["rank"], **_compile_fields(target), "times": _times(target),
                  **({"draft": {**_compile_fields(draft), "times": _times(draft)}}
                     if draft is not None else {})}
                 for st, (target, draft) in zip(rank_states or [{"rank": 0}], parts)]
        first, first_draft = parts[0]
        return {
            "model": mc.model, "architecture": mc.architecture, "num_layers": mc.num_layers,
            "device": kiln_config.device_config.device,
            "dtype": str(mc.torch_dtype).removeprefix("torch."),
            "compilation_mode": int(cc.mode), "compilation_mode_name": CompilationMode(cc.mode).name,
            "backend": cc.backend, "splitting_ops": list(cc.splitting_ops),
            "ir_ops": kiln_config.ir_selection.as_dict(),  # each IR op's chosen provider
            "ir_ops_used": _ops_in_use(kiln_config),
            **_compile_fields(first),
            "shapes": {"range": [1, kiln_config.scheduler_config.max_num_batched_tokens],
                       "compile_sizes": list(cc.compile_sizes)},
            "times": {"total_s": total_s, "config_s": config_s, **timings,
                      "trace_s": first["trace_s"], "compile_s": first["compile_s"],
                      "artifact_load_s": first["load_s"]},
            **({"ranks": ranks} if rank_states else {}),
            **_draft_report(kiln_config, first_draft),
        }
    finally:
        core.shutdown()


# ---- cold vs warm, each in a fresh process --------------------------------------------------

def child_env(base: dict, root: Path) -> dict:
    """The environment of a `kiln compile` child: the compile cache on, and any Inductor cache
    use before Kiln points it under its own cache landing in `root`, where it is visible."""
    if envs.disable_compile_cache():
        raise ValueError("KILN_DISABLE_COMPILE_CACHE is set: a warm start would compile again; "
                         "unset it to run `kiln bench compile`")
    env = dict(base)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor_outside_kiln_cache")
    env.pop("TRITON_CACHE_DIR", None)  # Triton's cache then follows Inductor's
    return env


def _files_under(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def start_figures(report: dict, wall_s: float) -> dict:
    t = report["times"]
    return {"process_wall_s": wall_s, "startup_s": t["total_s"],
            "load_model_s": t.get("load_model_s"), "warmup_s": t.get("warmup_s"),
            "torch_compile_s": t["trace_s"] + t["compile_s"] + t["artifact_load_s"],
            "trace_s": t["trace_s"], "compile_s": t["compile_s"],
            "artifact_load_s": t["artifact_load_s"],
            "num_inductor_compiles": report["inductor"]["compiles"],
            "num_compiled_artifacts_loaded": report["inductor"]["artifacts_loaded"],
            "num_compiled_artifacts_saved": report["inductor"]["artifacts_saved"],
            "cache_hits": report["cache"]["hits"], "cache_misses": report["cache"]["misses"],
            "cache_dirs": report["cache"]["dirs"],
            **({"draft": _draft_figures(report["draft"])} if "draft" in report else {})}


def _draft_figures(d: dict) -> dict:
    """A speculative draft's part of a start (its own compile, inside the warm-up)."""
    t = d["times"]
    return {"torch_compile_s": t["trace_s"] + t["compile_s"] + t["load_s"],
            "num_inductor_compiles": d["inductor"]["compiles"],
            "num_compiled_artifacts_loaded": d["inductor"]["artifacts_loaded"],
            "cache_hits": d["cache"]["hits"], "cache_misses": d["cache"]["misses"]}


def _ratio(a, b):
    return a / b if a is not None and b else None


def run_compile_bench(engine_args: EngineArgs, keep_cache: bool = False,
                      timeout: float | None = None) -> dict:
    """Cold start on an empty cache, then a warm start on the same cache, in two processes."""
    base = spec_to_dict(engine_args.compilation_config)
    if engine_args.compilation().mode == CompilationMode.NONE or engine_args.enforce_eager:
        raise ValueError("`kiln bench compile` needs compilation on: drop --enforce-eager / -O0")
    engine_args.create_kiln_config()  # a bad flag fails here, as a usage error, not in a child
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-compile-"))
    try:
        spec = {**base, "cache_dir": str(root / "torch_compile_cache")}
        args = dataclasses.replace(engine_args, compilation_config=spec)
        argv = CHILD_COMMAND + args.to_cli_args()
        env = child_env(dict(os.environ), root)
        runs = {}
        for name in ("cold", "warm"):
            logger.info("bench compile: %s start: %s", name, shlex.join(argv))
            report, wall = run_json_child(argv, timeout=timeout, env=env)
            runs[name] = start_figures(report, wall)
        # Model, pieces and shapes are the same in both reports; take them from the last.
        cold, warm = runs["cold"], runs["warm"]
        return {
            "benchmark": "compile", "model": report["model"], "device": report["device"],
            "dtype": report["dtype"], "compilation_mode": report["compilation_mode"],
            "pieces": report["pieces"], "shapes": report["shapes"],
            "cold": cold, "warm": warm,
            "warm_vs_cold_startup": _ratio(warm["startup_s"], cold["startup_s"]),
            "warm_vs_cold_torch_compile": _ratio(warm["torch_compile_s"],
                                                 cold["torch_compile_s"]),
            "warm_vs_cold_process": _ratio(warm["process_wall_s"], cold["process_wall_s"]),
            "cache_dir": str(root / "torch_compile_cache"), "cache_kept": keep_cache,
            "inductor_files_outside_kiln_cache": _files_under(root / "inductor_outside_kiln_cache"),
            "command": argv,
        }
    finally:
        if not keep_cache:
            shutil.rmtree(root, ignore_errors=True)
