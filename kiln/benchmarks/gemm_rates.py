"""Each decoder linear's GEMM alone at a prefill step's rows: the W8A8 int8 panel kernel against
the bfloat16 one the unquantized engine runs (oneDNN's packed weight), one thread, in MACs/s;
beside them the ops the int8 engine runs instead of the bfloat16 one's around the GEMMs (gate_up
with its SiLU-and-mul + quant, add + RMSNorm with its quant).

`python -m kiln.benchmarks.gemm_rates` (SmolLM2-135M's shapes, 2048 rows): CPU time
(`time.thread_time`), the minimum of interleaved runs, so a loaded host moves it little.
"""
import argparse
import json
import time

import torch

from kiln.benchmarks.cpu_info import cpu

# SmolLM2-135M (hidden 576, intermediate 1536, 9 query and 3 kv heads of 64): (out, in)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_cpu_s(fns: dict, rounds: int) -> dict:
    """The least thread CPU seconds of each callable over `rounds` interleaved calls."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()
            fn()
            best[name] = min(best[name], time.thread_time() - start)
    return best


def gemm_calls(rows: int, out_features: int, in_features: int, silu_quant: bool = False) -> dict:
    """The two engines' calls for one linear: the bfloat16 packed GEMM, the int8 activation
    quantization, the int8 panel GEMM (on the quantized rows); with silu_quant also the panel
    GEMM with the SiLU-and-mul and quant after it (an MLP's gate/up projection)."""
    from kiln.ir import int8_panels
    from kiln.ir import quant as ir_quant
    from kiln.native import build, int8_ops

    if not build.available() or int8_ops.isa() is None:  # (available() loads the ops)
        raise SystemExit("the native int8 kernels are not available on this machine")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    plan = torch.tensor([0, 0, 3], dtype=torch.int64)  # no GEMV, no blocks: the packed GEMM
    q, scale = int8_ops.dynamic_int8_quant(x)
    w_q, w_scale = ir_quant.dynamic_int8_quant.reference(w)
    panels = int8_panels.pack_int8_panels(w_q)
    w_scale = w_scale.reshape(-1)
    calls = {"bf16": lambda: torch.ops.kiln.linear_native(x, w, None, packed, plan),
             "quant": lambda: int8_ops.dynamic_int8_quant(x),
             "int8": lambda: int8_ops.int8_scaled_mm_panels(q, scale, panels, w_scale, None,
                                                            torch.bfloat16)}
    if silu_quant:
        calls["int8_silu_quant"] = lambda: int8_ops.int8_scaled_mm_panels_silu_quant(
            q, scale, panels, w_scale, None, torch.bfloat16)
    return calls


def norm_calls(rows: int, hidden: int) -> dict:
    """A layer's add + RMSNorm as the bfloat16 engine runs it and with the int8 engine's
    quantization of its output (the residual kept apart: the ops write it in place)."""
    from kiln.native import int8_ops, layer_ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    return {"bf16": lambda: layer_ops.rms_norm(x, weight, 1e-5, residual.clone()),
            "int8": lambda: int8_ops.fused_add_rms_norm_dynamic_int8_quant(
                x, residual.clone(), weight, 1e-5),
            "clone": lambda: residual.clone()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2048, help="max_num_batched_tokens' default")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()  # the caller's, restored: later compile cache keys read it
    torch.set_num_threads(1)
    try:
        report = _measure(args)
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(report))
    return report


def _measure(args) -> dict:
    report = {**cpu(), "rows": args.rows}  # cpu(): the machine, threads (1) and torch
    for name, (n, k) in SHAPES.items():
        calls = gemm_calls(args.rows, n, k, silu_quant=name == "gate_up")
        for fn in calls.values():
            fn()  # warm: oneDNN's primitive, the pages
        s = best_cpu_s(calls, args.rounds)
        macs = args.rows * n * k
        report[name] = {"bf16_ms": round(s["bf16"] * 1e3, 3),
                        "int8_ms": round(s["int8"] * 1e3, 3),
                        "quant_ms": round(s["quant"] * 1e3, 3),
                        "bf16_gmacs": round(macs / s["bf16"] / 1e9, 1),
                        "int8_gmacs": round(macs / s["int8"] / 1e9, 1),
                        "int8_speedup": round(s["bf16"] / s["int8"], 3)}
        if "int8_silu_quant" in s:  # the op the int8 engine runs: GEMM, SiLU-and-mul, quant
            report[name]["int8_silu_quant_ms"] = round(s["int8_silu_quant"] * 1e3, 3)
    calls = norm_calls(args.rows, SHAPES["o"][0])
    for fn in calls.values():
        fn()
    s = best_cpu_s(calls, args.rounds)
    # each op's time less the residual's copy, which the engines' in-place calls do not make
    report["add_rms_norm"] = {"bf16_ms": round((s["bf16"] - s["clone"]) * 1e3, 3),
                              "int8_quant_ms": round((s["int8"] - s["clone"]) * 1e3, 3)}
    return report


if __name__ == "__main__":
    main()
