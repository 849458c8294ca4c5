"""Micro-benchmark of the MoE ops on the CPU: the native provider (kiln/ir/moe_native.py: float
experts in one C++ call a layer on the weights as stored, int8 experts in panels) against the
torch reference, in one invocation, on a Mixtral-like layer; prints one JSON object
(`python -m kiln.benchmarks.moe --help`). A CPU without AMX, on one with it:
KILN_NATIVE_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16.
"""
import argparse
import json
import os
import time

import torch

from kiln import envs, ir
from kiln.benchmarks.cpu_info import cpu
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.moe_cpu import pack_int8_experts
from kiln.model.layers.quantization.moe_int8 import quantize_experts
from kiln.native import build, int8_ops


def machine() -> dict:
    return {**cpu(), "int8_isa": int8_ops.isa(),
            # a lower CPU's kernels on this one (KILN_NATIVE_CFLAGS="-mno-amx-tile ...": no AMX)
            # and oneDNN's (ONEDNN_MAX_CPU_ISA, for aten's GEMMs and the reference)
            "native_cflags": envs.native_cflags(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "moe_tiles": torch.ops.kiln.fused_experts_tiles(),
            "moe_rows_isa": [torch.ops.kiln.fused_experts_rows_isa(d) for d in (0, 1)]}


def _time_ms(fn, iters: int, clock=time.perf_counter) -> float:
    fn()  # warm-up: oneDNN primitives, first-touch
    times = []
    for _ in range(iters):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times) * 1e3  # the least disturbed run (a shared machine's others add noise)


def _experts(args, quantized: bool, dtype: torch.dtype) -> FusedMoE:
    moe = FusedMoE(args.experts, args.top_k, args.hidden, args.intermediate, renormalize=True,
                   tp_rank=0, tp_size=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.w13_weight.normal_(0, 0.02, generator=g)
        moe.w2_weight.normal_(0, 0.02, generator=g)
    if quantized:
        quantize_experts(moe)
    return moe.to(dtype) if not quantized else moe


@torch.no_grad()
def run(args) -> dict:
    # one thread's CPU time leaves out the time a loaded machine's other work takes the core
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows = []
    for kind in args.dtypes:
        # float32 experts take float32 activations; bfloat16 and int8 ones bfloat16
        act = torch.float32 if kind == "float32" else torch.bfloat16
        moe = _experts(args, kind == "int8", act)
        if kind == "int8":
            stored = (moe.w13_weight, moe.w13_weight_scale, moe.w2_weight, moe.w2_weight_scale)
            ref_fn = ir.fused_moe_int8.reference
            packed = pack_int8_experts(moe)
            op = ir.fused_moe_int8_panels if packed else ir.fused_moe_int8
            weights = ((moe.w13_panels, moe.w13_weight_scale, moe.w2_panels, moe.w2_weight_scale)
                       if packed else stored)
            native_args = weights
        else:
            stored = (moe.w13_weight, moe.w2_weight)
            ref_fn, op = ir.fused_moe.reference, ir.fused_moe
            packed = False  # read as stored (csrc/moe_experts.cpp)
            native_args = stored
        native = op.impls["native"].fn
        for batch in args.batches:
            g = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, args.hidden, generator=g).to(act)
            logits = torch.randn(batch, args.experts, generator=g).to(act)
            ref_call = (x, logits, *stored, args.top_k, True)
            nat_call = (x, logits, *native_args, args.top_k, True)
            diff = (native(*nat_call).float() - ref_fn(*ref_call).float()).abs().max().item()
            ref_ms = _time_ms(lambda f=ref_fn, c=ref_call: f(*c), args.iters, clock)
            nat_ms = _time_ms(lambda f=native, c=nat_call: f(*c), args.iters, clock)
            rows.append({"weights": kind, "tokens": batch, "op": op.name, "packed": packed,
                         "reference_ms": round(ref_ms, 3), "native_ms": round(nat_ms, 3),
                         "speedup": round(ref_ms / nat_ms, 2), "max_abs_diff": diff})
    return {"machine": machine(), "shape": {"hidden": args.hidden,
                                            "intermediate": args.intermediate,
                                            "experts": args.experts, "top_k": args.top_k,
                                            "activations": "float32 experts: float32, else "
                                                           "bfloat16"},
            "clock": "thread CPU time" if args.cpu_time else "wall", "results": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32", "int8"],
                   default=["bfloat16", "int8"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the calling thread's CPU time (time.thread_time), not wall time: "
                        "only with --threads 1 (other threads' work is not counted)")
    args = p.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time counts one thread's time: pass --threads 1 with it")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not build.available():
        raise SystemExit("the native kernels are not built (no C++ compiler?): nothing to compare")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
