"""Per-step decode latency of LLMEngine.step at fixed batch sizes, for several compilation
configs in one process, with speedups vs the first; on CPU the engines take turns on each batch.
"""
import dataclasses
import math
import statistics
import time

from kiln.benchmarks.linear_floor import LinearFloor, above_floor, speedup_ceiling
from kiln.benchmarks.throughput import random_prompts
from kiln.config.compilation_config import spec_to_dict
from kiln.engine.arg_utils import EngineArgs
from kiln.logger import init_logger

logger = init_logger(__name__)

DEFAULT_COMPARE = ["0", "3"]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of a non-empty list."""
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    # Unrounded, so ratios computed from the report equal the report's own ratios.
    return {"median_ms": statistics.median(ms), "p90_ms": percentile(ms, 90),
            "mean_ms": statistics.fmean(ms), "min_ms": min(ms), "max_ms": max(ms),
            "num_steps": len(ms)}


def merge_spec(base, spec) -> dict:
    """A --compare item on top of the engine's -O: the item's fields win."""
    return {**spec_to_dict(base), **spec_to_dict(spec)}


def check_plan(batch_sizes: list[int], input_len: int, num_steps: int, warmup_steps: int,
               max_num_seqs: int, max_model_len: int) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {batch_sizes}")
    if input_len < 1 or num_steps < 1 or warmup_steps < 0:
        raise ValueError(f"--input-len and --num-steps must be >= 1 and --warmup-steps >= 0, got "
                         f"{input_len}, {num_steps}, {warmup_steps}")
    if max(batch_sizes) > max_num_seqs:
        raise ValueError(f"batch size {max(batch_sizes)} exceeds max_num_seqs ({max_num_seqs}): "
                         "raise --max-num-seqs so the whole batch decodes in one step")
    if input_len + warmup_steps + num_steps + 2 > max_model_len:
        raise ValueError(f"--input-len {input_len} + --warmup-steps {warmup_steps} + --num-steps "
                         f"{num_steps} (+2) exceeds max_model_len {max_model_len}; shorten them "
                         "or raise --max-model-len")


def check_kv_capacity(batch_size: int, tokens_per_request: int, num_blocks: int,
                      block_size: int) -> None:
    need = batch_size * math.ceil(tokens_per_request / block_size)
    if need > num_blocks:
        raise ValueError(f"batch {batch_size} x {tokens_per_request} tokens needs {need} KV blocks, "
                         f"the cache has {num_blocks}: requests would be preempted mid-measurement. "
                         "Raise --kv-cache-memory (CPU) / --gpu-memory-utilization, or lower "
                         "--batch-sizes / --num-steps")


def _check_decode_step(outs, batch_size: int, what: str) -> None:
    tokens = [len(o.outputs[0].token_ids) for o in outs if o.outputs]
    if len(outs) != batch_size or tokens != [1] * batch_size or any(o.finished for o in outs):
        raise RuntimeError(f"{what}: expected {batch_size} requests each decoding one token, got "
                           f"{len(outs)} outputs with {tokens} new tokens (preempted or finished "
                           "early?); raise --kv-cache-memory or --max-model-len")


STEPS_PER_TURN = 4  # interleaved runs: timed steps each engine takes per turn


def turn_lengths(num_steps: int, per_turn: int = STEPS_PER_TURN) -> list[int]:
    """num_steps cut into turns of per_turn (the last may be shorter)."""
    return [min(per_turn, num_steps - i) for i in range(0, num_steps, per_turn)]


def start_batch(engine, prompts: list[list[int]], warmup_steps: int, max_tokens: int,
                tag: str) -> list[str]:
    """Add the prompts, step until every one has its first token, then `warmup_steps` untimed
    decode steps; returns the request ids (abort them when done)."""
    from kiln.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    try:
        started: set[str] = set()
        for _ in range(sum(map(len, prompts)) + 1):  # a prefill step computes >= 1 token
            started.update(o.request_id for o in engine.step()
                           if o.outputs and o.outputs[0].token_ids)
            if len(started) == len(prompts):
                break
        else:
            raise RuntimeError(f"{tag}: prefill did not finish for every request")
        for i in range(warmup_steps):
            _check_decode_step(engine.step(), len(prompts), f"{tag} warm-up step {i}")
    except BaseException:
        engine.abort_request(ids)
        raise
    return ids


def time_steps(engine, num_steps: int, batch_size: int, tag: str) -> list[float]:
    """Seconds per LLMEngine.step for num_steps steps in which every request decodes one token."""
    times = []
    for i in range(num_steps):
        start = time.perf_counter()
        outs = engine.step()  # returns sampled tokens on the host: the step has finished
        times.append(time.perf_counter() - start)
        _check_decode_step(outs, batch_size, f"{tag} step {i}")
    return times


def measure_batch(engine, prompts: list[list[int]], num_steps: int, warmup_steps: int,
                  max_tokens: int, tag: str) -> list[float]:
    """Seconds per LLMEngine.step for `num_steps` steps in which every prompt decodes one token."""
    ids = start_batch(engine, prompts, warmup_steps, max_tokens, tag)
    try:
        return time_steps(engine, num_steps, len(prompts), tag)
    finally:
        engine.abort_request(ids)


def engine_runner(engine):
    """The model runner of an in-process engine's worker (None behind other executors: its
    ranks hold theirs)."""
    executor = getattr(engine.engine_core, "executor", None)
    return getattr(getattr(executor, "worker", None), "model_runner", None)


def engine_model(engine):
    """The model of an in-process engine's worker (None behind other executors)."""
    return getattr(engine_runner(engine), "model", None)


def model_weight_bytes(engine) -> int | None:
    """Bytes of the model's parameters and buffers (what one decode step must read at least)."""
    model = engine_model(engine)
    if model is None:
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)  # meta: let go


@dataclasses.dataclass
class Subject:
    """One compilation config's engine under test, with what the report says about it."""
    label: str
    spec: dict
    engine_args: EngineArgs
    engine: object
    kiln_config: object
    startup_s: float
    weight_bytes: int | None
    cudagraph_mode: str  # as the model runner resolved it (the request may be downgraded)
    results: dict = dataclasses.field(default_factory=dict)

    def prompts(self, batch_size: int, input_len: int) -> list[list[int]]:
        mc = self.kiln_config.model_config
        exclude = set(getattr(self.engine.tokenizer, "all_special_ids", []))
        return random_prompts(batch_size, input_len, mc.vocab_size,
                              self.engine_args.seed + batch_size, exclude)

    def max_tokens(self, input_len: int) -> int:
        """Generation budget of a prompt of input_len (the bench aborts long before it)."""
        return self.kiln_config.model_config.max_model_len - input_len

    def record(self, batch_size: int, times: list[float]) -> None:
        self.results[str(batch_size)] = summarize_ms(times)
        logger.info("bench latency: %s batch %d: median %.3f ms/step", self.label, batch_size,
                    self.results[str(batch_size)]["median_ms"])

    def report(self) -> dict:
        cc, mc = self.kiln_config.compilation_config, self.kiln_config.model_config
        return {"spec": self.label, "compilation_config": self.spec,
                "compilation_mode": int(cc.mode), "cudagraph_mode": self.cudagraph_mode,
                "startup_s": self.startup_s,
                "model_weight_bytes": self.weight_bytes, "model": mc.model,
                "dtype": str(mc.torch_dtype).removeprefix("torch."),
                "device": self.kiln_config.device_config.device, "results": self.results}


def start_subject(label: str, spec: dict, engine_args: EngineArgs, batch_sizes: list[int],
                  input_len: int, num_steps: int, warmup_steps: int) -> Subject:
    """Check the plan against this config's limits, then build its engine."""
    from kiln.engine.llm_engine import LLMEngine

    args = dataclasses.replace(engine_args, compilation_config=spec)
    kiln_config = args.create_kiln_config()
    mc, sched, cache = (kiln_config.model_config, kiln_config.scheduler_config,
                        kiln_config.cache_config)
    check_plan(batch_sizes, input_len, num_steps, warmup_steps, sched.max_num_seqs,
               mc.max_model_len)
    start = time.perf_counter()
    # In this process: a core process runs ahead of step(), and the model is read here.
    engine = LLMEngine(kiln_config, multiprocess=False)
    startup_s = time.perf_counter() - start
    runner = engine_runner(engine)
    # -tp / -pp: the ranks resolve the mode; the report gives the one asked for
    cudagraph_mode = (runner.cudagraph_dispatcher.cudagraph_mode.name if runner is not None
                      else f"{kiln_config.compilation_config.cudagraph_mode} (requested)")
    subject = Subject(label, spec, args, engine, kiln_config, startup_s,
                      model_weight_bytes(engine), cudagraph_mode)
    try:
        for b in batch_sizes:
            check_kv_capacity(b, input_len + warmup_steps + num_steps + 2,
                              engine.engine_core.num_blocks,
                              cache.block_size)
    except ValueError:
        engine.shutdown()
        raise
    return subject


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
