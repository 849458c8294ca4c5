"""Micro-benchmark of the CPU paged-attention kernels (decode, prefill, cache write) over each KV
cache dtype (--kv-cache-dtype), the model's bfloat16 cache as the baseline in the same process;
prints one JSON object (`python -m kiln.benchmarks.attention --help`).
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from kiln.attention.kv_cache_dtype import CACHE_DTYPES, to_cache, torch_cache_dtype
from kiln.benchmarks.cpu_info import cpu
from kiln.native import build
from kiln.native import paged_attention as pa
from kiln.native import prefill_attention as pf
from kiln.worker import input_prep

CASES = ("decode", "prefill", "write")
MODEL_DTYPE = torch.bfloat16  # the queries' and the "auto" cache's


class Step:
    """`seqs` requests of `new` tokens each after `context` cached ones, over a cache whose
    blocks are handed out in a seeded shuffled order (a served cache's are scattered): the
    kernels' step arguments and the cache's block count."""

    def __init__(self, seqs: int, new: int, context: int, block_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        per_seq = -(-(context + new) // block_size)
        self.num_blocks = seqs * per_seq
        block_table = torch.randperm(self.num_blocks, generator=g).to(torch.int32).view(seqs, -1)
        scheduled = np.full(seqs, new, dtype=np.int64)
        computed = np.full(seqs, context, dtype=np.int64)
        slots = input_prep.slot_mapping(block_table.numpy(),
                                        input_prep.token_request_indices(scheduled),
                                        input_prep.positions(computed, scheduled), block_size)
        self.num_tokens = seqs * new
        self.block_table, self.block_size = block_table, block_size
        self.query_start_loc = torch.from_numpy(input_prep.query_start_loc(scheduled))
        self.seq_lens = torch.full((seqs,), context + new, dtype=torch.int32)
        self.slots, self.max_seq_len = torch.from_numpy(slots), context + new

    def args(self, attend: bool, write: bool) -> pa.StepArgs:
        """The step attending all its requests (or none) and writing its tokens' K/V (or none)."""
        reqs = torch.arange(self.seq_lens.numel() if attend else 0, dtype=torch.int32)
        slots = self.slots if write else self.slots[:0]
        return pa.StepArgs(self.block_table, self.query_start_loc, self.seq_lens, reqs,
                           self.max_seq_len, self.block_size, slots, self.num_tokens if write else 0)


def _case_calls(case: str, step: Step, args, caches: dict) -> dict:
    """Cache dtype name -> a call of the case's kernel over that cache. The q, k, v rows are
    column slices of one fused qkv projection, as a layer hands them over."""
    nh, nkv, hd = args.heads, args.kv_heads, args.head_size
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(step.num_tokens, (nh + 2 * nkv) * hd, generator=g).to(MODEL_DTYPE)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
    out = torch.empty(step.num_tokens, nh * hd, dtype=MODEL_DTYPE)
    scale = hd ** -0.5
    if case == "prefill":  # its tokens' K/V are in the cache already (written by paged_attention)
        st = step.args(attend=True, write=False)
        return {name: (lambda c=c: pf.run(q, out, c, st, scale)) for name, c in caches.items()}
    # a decode step writes its tokens' K/V, then attends; the write case only writes
    st = step.args(attend=case == "decode", write=True)
    return {name: (lambda c=c: pa.run(q, k, v, out, c, st, scale)) for name, c in caches.items()}


def _caches(step: Step, args) -> dict[str, torch.Tensor]:
    """Cache dtype name -> a [2, nb, bs, nkv, hd] cache of the same random K/V in that dtype."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, step.num_blocks, step.block_size, args.kv_heads, args.head_size,
                       generator=g, dtype=MODEL_DTYPE)
    return {name: to_cache(base, torch_cache_dtype(name, MODEL_DTYPE))
            for name in args.cache_dtypes}


def time_alternated(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Name -> ms of each of `rounds` calls, the calls taking turns (each round starts one later
    in the order, so no one always follows the same other); one warm-up call each first."""
    for fn in calls.values():
        fn()
    names, times = list(calls), {name: [] for name in calls}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: dict[str, list[float]]) -> dict:
    """Per name its min and median ms and their ratios to "auto"'s (the bfloat16 cache)."""
    base_min, base_med = min(times["auto"]), statistics.median(times["auto"])
    return {name: {"min_ms": _digits(min(t)), "median_ms": _digits(statistics.median(t)),
                   "min_ratio_to_auto": _digits(min(t) / base_min),
                   "median_ratio_to_auto": _digits(statistics.median(t) / base_med)}
            for name, t in times.items()}


def _digits(x: float) -> float:
    return float(f"{x:.4g}")  # significant digits: a tiny shape's microseconds stay above 0


def cases(args) -> list[tuple[str, str, Step]]:
    """(case, label, its step) for each case asked for."""
    out = []
    if "decode" in args.cases:
        out += [("decode", f"decode {n} x {keys} keys", Step(n, 1, keys - 1, args.block_size))
                for n, keys in args.decode]
    if "prefill" in args.cases:
        n, new, ctx = args.prefill
        out.append(("prefill", f"prefill {n} x {new} over {ctx}",
                    Step(n, new, ctx, args.block_size)))
    if "write" in args.cases:
        out.append(("write", f"write {args.write_rows} rows",
                    Step(1, args.write_rows, 0, args.block_size)))
    return out


@torch.no_grad()
def run(args) -> dict:
    rows = []
    for case, label, step in cases(args):
        caches = _caches(step, args)
        calls = _case_calls(case, step, args, caches)
        for threads in args.threads:
            torch.set_num_threads(threads)
            rows.append({"case": case, "label": label, "threads": threads,
                         "cache": summary(time_alternated(calls, args.rounds))})
        del calls, caches
    hd = args.head_size
    machine = {**cpu(), "threads": args.threads, "load_average": list(os.getloadavg()),
               "decode_bf16_dot": {name: pa.bf16_dot(torch_cache_dtype(name, MODEL_DTYPE), hd)
                                   for name in args.cache_dtypes},
               "prefill_amx": pf.amx(MODEL_DTYPE, hd), "prefill_simd": pf.simd(MODEL_DTYPE, hd)}
    return {"machine": machine,
            "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_size": hd,
                      "block_size": args.block_size, "queries": "bfloat16"},
            "rounds": args.rounds, "results": rows}


def _shape(text: str, last_min: int = 1) -> tuple[int, ...]:
    """"32x2048" -> (32, 2048): positive integers joined by x (the last >= last_min)."""
    try:
        parts = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        parts = ()
    if not parts or min(parts[:-1], default=1) < 1 or parts[-1] < last_min:
        what = "positive integers" if last_min else "positive integers (the last may be 0)"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} joined by 'x'")
    return parts


def _prefill_shape(text: str) -> tuple[int, ...]:
    """SEQSxNEWxCONTEXT: a prefill with no cached context (CONTEXT 0) is the usual one."""
    return _shape(text, last_min=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--decode", type=_shape, nargs="+", default=[(32, 2048), (32, 512)],
                   metavar="SEQSxKEYS", help="decode steps: sequences x keys each")
    p.add_argument("--prefill", type=_prefill_shape, default=(2, 512, 1024),
                   metavar="SEQSxNEWxCONTEXT", help="a prefill step: sequences x new tokens x "
                                                    "cached tokens before them")
    p.add_argument("--write-rows", type=int, default=32768, help="K/V rows the write case stores")
    p.add_argument("--cache-dtypes", nargs="+", choices=CACHE_DTYPES,
                   default=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="--kv-cache-dtype values to compare (auto, the baseline, among them)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads")
    args = p.parse_args(argv)
    for flag, value in (("--heads", args.heads), ("--kv-heads", args.kv_heads),
                        ("--head-size", args.head_size), ("--block-size", args.block_size),
                        ("--write-rows", args.write_rows), ("--rounds", args.rounds),
                        ("--threads", min(args.threads))):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if any(len(s) != 2 for s in args.decode):
        p.error("--decode takes SEQSxKEYS shapes, e.g. 32x2048")
    if len(args.prefill) != 3:
        p.error("--prefill takes one SEQSxNEWxCONTEXT shape, e.g. 2x512x1024")
    if "auto" not in args.cache_dtypes:
        p.error("--cache-dtypes must include auto: the ratios are to its bfloat16 cache")
    args.cache_dtypes = list(dict.fromkeys(args.cache_dtypes))  # "fp8" twice would time it twice
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not build.available():
        raise SystemExit("the native kernels are not built (no C++ compiler?): nothing to time")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
