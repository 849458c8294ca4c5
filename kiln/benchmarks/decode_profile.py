"""Where a decode step's time goes, and how a step scales over threads: decode steps of N running
requests at a given context (the `--input-len 512 --output-len 32` bench's steps of 32 rows),
each engine's step profiled by category as prefill_profile does, and timed on each thread count.

`python -m kiln.benchmarks.decode_profile --quantization int8 --threads 1 2` runs the
unquantized engine beside the quantized one, in turns, and prints one JSON report: per engine the
1-thread step's ms by category, and per thread count the step's wall time, the stepping thread's
CPU time and the process's (which counts OpenMP threads spinning between regions); with
`--prefill` the same timings for prefill steps of max_num_batched_tokens rows.
"""
import argparse
import dataclasses
import json
import os
import random
import statistics
import time

import torch

from kiln.benchmarks import prefill_profile as pp
from kiln.benchmarks.cpu_info import cpu
from kiln.benchmarks.decode_steps import check_decode_step, start_batch
from kiln.config.quantization_rotation import CHOICES as ROTATION_CHOICES


def timed(fn):
    """(fn's result, {"wall", "thread", "process"} seconds it took)."""
    w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
    out = fn()
    return out, {"wall": time.perf_counter() - w, "thread": time.thread_time() - t,
                 "process": time.process_time() - p}


def profiled(fn):
    """(fn's result, seconds {"wall", "thread", "process"}, the stepping thread's profiler
    events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        out, secs = timed(fn)
    thread = pp.step_thread(prof)
    return out, secs, [e for e in prof.events() if e.thread == thread]


def timing_summary(runs: list[dict]) -> dict:
    """Min and median ms of each clock over timed steps, and process CPU / wall (how many cores
    the step kept busy, spinning included)."""
    out = {}
    for clock in ("wall", "thread", "process"):
        ms = [r[clock] * 1000 for r in runs]
        out[f"{clock}_min_ms"] = round(min(ms), 3)
        out[f"{clock}_median_ms"] = round(statistics.median(ms), 3)
    out["busy_cores"] = round(statistics.median(r["process"] / r["wall"] for r in runs), 3)
    return out


def speedups(report: dict, quant: str, threads: list[int], phase: str) -> dict:
    """The unquantized engine's step time over the quantized one's, per thread count and clock
    (min over steps: the least disturbed step of each)."""
    out = {}
    for t in threads:
        q, b = report[quant][phase][str(t)], report["unquantized"][phase][str(t)]
        out[str(t)] = {c: round(b[f"{c}_min_ms"] / q[f"{c}_min_ms"], 4)
                       for c in ("wall", "thread", "process")}
    return out


def prefill_rounds(engines: dict, n: int, input_len: int, threads: list[int], steps: int,
                   vocab: int, rng: random.Random) -> dict:
    """Seconds of `steps` prefill steps of n x input_len rows per engine and thread count (a
    warm-up round first), each step's requests finishing in it."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    runs = {name: {str(t): [] for t in threads} for name in engines}
    for r in range(steps + 1):
        prompts = [[rng.randrange(1000, vocab - 1) for _ in range(input_len)] for _ in range(n)]
        for t in threads:
            torch.set_num_threads(t)
            for name, engine in engines.items():
                for i, p in enumerate(prompts):
                    engine.add_request(f"pre-{name}-{r}-{t}-{i}", {"prompt_token_ids": p},
                                       params)
                outs, secs = timed(engine.step)
                if sum(o.finished for o in outs) != n or engine.has_unfinished_requests():
                    raise RuntimeError(f"{name}: a prefill step did not finish all {n} prompts; "
                                       "lower --input-len")
                if r:
                    runs[name][str(t)].append(secs)
    return {name: {t: timing_summary(v) for t, v in per.items()} for name, per in runs.items()}


def decode_rounds(engines: dict, args, threads: list[int], dims: dict, batched: int,
                  rng: random.Random) -> tuple[dict, dict]:
    """(seconds of each engine's timed decode steps per thread count, its profiled 1-thread
    steps' ms by category and thread CPU seconds)."""
    n = args.num_requests
    per_round = len(threads) + 1  # timed steps on each thread count, then one profiled
    # the first requests decode while the rest prefill: none may finish in a timed step
    prefill_steps = -(-n * args.context // batched)
    max_tokens = prefill_steps + 2 + (args.steps + 1) * per_round + 8
    prompts = [[rng.randrange(1000, dims["vocab"] - 1) for _ in range(args.context)]
               for _ in range(n)]
    ids = {}
    runs = {name: {str(t): [] for t in threads} for name in engines}
    profiles = {name: ([], []) for name in engines}
    try:
        torch.set_num_threads(max(threads))  # the prompts' prefill, untimed
        for name, engine in engines.items():
            ids[name] = start_batch(engine, prompts, 1, max_tokens, f"dec-{name}", 1.0)
        for r in range(args.steps + 1):  # the first round warms up each thread count
            for t in threads:
                torch.set_num_threads(t)
                for name, engine in engines.items():
                    outs, secs = timed(engine.step)
                    check_decode_step(outs, n, f"{name} decode step")
                    if r:
                        runs[name][str(t)].append(secs)
            torch.set_num_threads(1)
            for name, engine in engines.items():
                outs, secs, events = profiled(engine.step)
                check_decode_step(outs, n, f"{name} profiled decode step")
                if r:
                    # op times are the profiler's wall clock: the step's CPU time in its
                    # proportions (one thread: its CPU time is the step's)
                    scale = secs["thread"] / secs["wall"] / 1000
                    steps, cpus = profiles[name]
                    steps.append({c: us * scale for c, us in pp.attribute(events, dims).items()})
                    cpus.append(secs["thread"])
    finally:
        for name, rid in ids.items():
            engines[name].abort_request(rid)
    return runs, profiles


def main(argv=None) -> dict:
    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--quantization-rotation", default="auto", choices=ROTATION_CHOICES,
                    help="the quantized engine's (kiln/config/quantization_rotation.py); the "
                         "unquantized baseline runs none")
    ap.add_argument("--num-requests", type=int, default=32, help="rows a decode step")
    ap.add_argument("--context", type=int, default=528,
                    help="tokens each request holds (512 in + 16 of 32 out)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per engine and thread "
                    "count (and profiled 1-thread steps)")
    ap.add_argument("--prefill", action="store_true",
                    help="also time prefill steps of max_num_batched_tokens rows")
    ap.add_argument("--input-len", type=int, default=512, help="the prefill steps' prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.threads) < 1 or args.steps < 1 or args.num_requests < 1 or args.context < 1:
        raise SystemExit("--threads, --steps, --num-requests and --context must be >= 1")
    threads_before = torch.get_num_threads()  # restored: later compile cache keys read it
    base_args = EngineArgs(model=args.model, dtype=args.dtype, seed=args.seed,
                           enable_prefix_caching=False)
    quant_args = dataclasses.replace(base_args, quantization=args.quantization,
                                     quantization_rotation=args.quantization_rotation)
    engines = {"unquantized": LLMEngine(base_args.create_kiln_config(), multiprocess=False),
               args.quantization: LLMEngine(quant_args.create_kiln_config(), multiprocess=False)}
    try:
        cfg = engines["unquantized"].kiln_config
        hf = cfg.model_config.hf_config
        dims = pp.model_dims(getattr(hf, "text_config", hf))
        rng = random.Random(args.seed)
        batched = cfg.scheduler_config.max_num_batched_tokens
        runs, profiles = decode_rounds(engines, args, args.threads, dims, batched, rng)
        report = {**cpu(), "model": cfg.model_config.model, "dtype": args.dtype,
                  # as resolved ("auto" says nothing of what ran)
                  "quantization_rotation":
                      engines[args.quantization].kiln_config.model_config.quantization_rotation,
                  "num_requests": args.num_requests, "context": args.context,
                  "threads": args.threads, "steps": args.steps,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                  "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}
        for name in engines:
            report[name] = {"decode_profile": pp.summarize(*profiles[name]),
                            "decode": {t: timing_summary(v) for t, v in runs[name].items()}}
        report["decode_ceilings"] = pp.ceilings(
            report[args.quantization]["decode_profile"], report["unquantized"]["decode_profile"],
            ("qkv", "o", "gate_up", "down"))
        report["decode_speedups"] = speedups(report, args.quantization, args.threads, "decode")
        if args.prefill:
            n = max(1, batched // args.input_len)
            for name, per in prefill_rounds(engines, n, args.input_len, args.threads,
                                            args.steps, dims["vocab"], rng).items():
                report[name]["prefill"] = per
            report["prefill_rows"] = n * args.input_len
            report["prefill_speedups"] = speedups(report, args.quantization, args.threads,
                                                  "prefill")
        report["load_avg"] = os.getloadavg()
    finally:
        for engine in engines.values():
            engine.shutdown()
        torch.set_num_threads(threads_before)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
