"""Where a prefill step's time goes: full prefill steps of LLMEngine.step (max_num_batched_tokens
rows) under torch.profiler, each op's time put in a category (per linear projection, quant, norm,
attention, LM head, sampler, other ops, the rest of the step: Python, scheduler), per engine,
on one thread, in ms of the step's CPU time.

`python -m kiln.benchmarks.prefill_profile --quantization int8 --dtype bfloat16` profiles the
unquantized engine beside the quantized one, in turns, and prints one JSON report with the
ratio infinitely fast / twice as fast linears would give (the ceiling of a faster GEMM).
"""
import argparse
import dataclasses
import json
import os
import random
import statistics
import time

import torch

from kiln.benchmarks.cpu_info import cpu
from kiln.config.quantization_rotation import CHOICES as ROTATION_CHOICES

# Ops whose time counts as a linear projection, by (out, in) features at the call: the IR ops'
# kernels (csrc/linear_op.cpp, ops_int8.cpp; the int8 gate_up op's SiLU-and-mul + quant with
# it) and aten's. A norm or SiLU fused before a float linear (kiln::add_rms_norm_linear) is a
# norm / activation op, less the linear it calls.
LINEAR_OPS = ("kiln::linear_native", "kiln::gguf_linear_native", "kiln::int8_scaled_mm",
              "aten::linear", "aten::mm", "aten::addmm", "aten::_int_mm",
              "mkldnn::_linear_pointwise")
# The rest by name fragment, first match wins (a fused op names its first step).
OTHER_CATEGORIES = (("quant", ("int8_quant",)),
                    ("attention", ("attention",)),
                    ("norm", ("rms_norm", "layer_norm")),
                    ("activation", ("silu", "gelu")),
                    ("rotary", ("rotary",)),
                    ("kv_cache", ("kv_cache", "reshape_and_cache")),
                    ("sampler", ("sample", "topk", "top_k", "softmax", "multinomial",
                                 "exponential", "argmax")),
                    ("embedding", ("embedding",)))


def projection(out_features: int, in_features: int, dims: dict) -> str:
    """The projection a linear of this shape is in a decoder layer of `dims` (hidden,
    intermediate, q_size, kv_size, vocab), or `linear_{out}x{in}` for none of them."""
    h, i = dims["hidden"], dims["intermediate"]
    shapes = {(dims["q_size"] + 2 * dims["kv_size"], h): "qkv", (h, dims["q_size"]): "o",
              (2 * i, h): "gate_up", (h, i): "down", (dims["vocab"], h): "lm_head"}
    return shapes.get((out_features, in_features), f"linear_{out_features}x{in_features}")


def linear_shape(name: str, shapes: list) -> tuple[int, int] | None:
    """(out, in) features of a linear op call from its input shapes, None where they do not say
    (x [M, K] first; the weight [N, K], int8 panels [N / 64, K / 4, 64, 4] with the scales [N]
    fourth, or oneDNN's packed copy, whose shape is the weight's)."""
    if len(shapes) < 2 or len(shapes[0]) < 2:
        return None
    k = shapes[0][-1]
    if "int8_scaled_mm" in name and len(shapes) > 3 and len(shapes[3]) == 1:
        return shapes[3][0], k
    if "_int_mm" in name and len(shapes[1]) == 2:
        return shapes[1][1], k  # w_q.t(): [K, N]
    if name in ("aten::mm",) and len(shapes[1]) == 2:
        return shapes[1][1], k
    if name == "aten::addmm" and len(shapes) > 2 and len(shapes[2]) == 2:
        return shapes[2][1], shapes[1][-1]
    for s in shapes[1:]:
        if len(s) == 2 and s[1] == k:
            return s[0], s[1]
    return None


def category(name: str, shapes: list, dims: dict) -> str | None:
    """The category of one profiled op call, None for an op of no category (its time stays
    with the op that called it, or goes to `other_ops` at the top)."""
    if any(name.startswith(op) for op in LINEAR_OPS):
        shape = linear_shape(name, shapes)
        if shape is not None:
            return projection(*shape, dims)
    if not (name.startswith("kiln::") or name.startswith("aten::")
            or name.startswith("mkldnn::")):
        return None
    for cat, fragments in OTHER_CATEGORIES:
        if any(f in name for f in fragments):
            return cat
    return None


def attribute(events, dims: dict) -> dict:
    """Microseconds per category over profiler `events` (FunctionEvents of one thread): an op
    of a category gets its time less that of the categorized ops below it; uncategorized ops
    with no categorized op above them add up as `other_ops`."""
    totals: dict[str, float] = {}
    cats = {id(e): category(e.name, e.input_shapes or [], dims) for e in events}

    def below(e) -> float:
        """Time of the nearest categorized ops under e."""
        t = 0.0
        for c in e.cpu_children:
            t += c.cpu_time_total if cats[id(c)] else below(c)
        return t

    def visit(e, inside: bool) -> None:
        cat = cats[id(e)]
        if cat:
            totals[cat] = totals.get(cat, 0.0) + e.cpu_time_total - below(e)
        elif not inside and (e.name.startswith(("aten::", "kiln::", "mkldnn::"))):
            totals["other_ops"] = totals.get("other_ops", 0.0) + e.cpu_time_total - below(e)
            inside = True
        for c in e.cpu_children:
            visit(c, inside or bool(cat))

    for e in events:
        if e.cpu_parent is None:
            visit(e, False)
    return totals


def model_dims(hf_config) -> dict:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    return {"hidden": hf_config.hidden_size, "intermediate": hf_config.intermediate_size,
            "q_size": heads * head_dim, "kv_size": kv * head_dim,
            "vocab": hf_config.vocab_size}


def prefill_step(engine, prompts: list[list[int]], tag: str, profile: bool):
    """Add `prompts` (one step's worth), run the step that prefills them all: (wall s, thread
    CPU s, the profiler's events or None). Each request asks for one token, so it finishes."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      record_shapes=True)
        prof.__enter__()
    start, cpu = time.perf_counter(), time.thread_time()
    outs = engine.step()
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    if prof is not None:
        prof.__exit__(None, None, None)
    done = [o for o in outs if o.finished]
    if len(done) != len(prompts) or engine.has_unfinished_requests():
        raise RuntimeError(f"{tag}: the step did not prefill all {len(prompts)} prompts "
                           f"({len(done)} finished); lower --num-prompts or raise "
                           "--max-num-batched-tokens")
    events = None
    if prof is not None:
        thread = step_thread(prof)
        events = [e for e in prof.events() if e.thread == thread]
    return wall, cpu, events


def step_thread(prof) -> int:
    """The thread that ran the step (the one with the most events)."""
    counts: dict[int, int] = {}
    for e in prof.events():
        counts[e.thread] = counts.get(e.thread, 0) + 1
    return max(counts, key=counts.get)


def summarize(steps: list[dict], cpus: list[float]) -> dict:
    """Median ms per category over profiled steps and the step's median CPU time; `rest` the
    step's time in no op (Python, the scheduler, the graph's own glue)."""
    cats = sorted({c for s in steps for c in s})
    out = {c: round(statistics.median(s.get(c, 0.0) for s in steps), 3) for c in cats}
    step_ms = statistics.median(cpus) * 1000
    out["rest"] = round(step_ms - sum(out.values()), 3)
    return {"step_cpu_ms": round(step_ms, 3), "ms": out}


def ceilings(quant: dict, base: dict, linears: tuple[str, ...]) -> dict:
    """The quantized engine's step speedup over the base's as measured, and with its linears
    infinitely fast / twice as fast as the base's (the rest of its step as measured)."""
    q_lin = sum(quant["ms"].get(c, 0.0) for c in linears)
    b_lin = sum(base["ms"].get(c, 0.0) for c in linears)
    q_step, b_step = quant["step_cpu_ms"], base["step_cpu_ms"]
    q_rest = q_step - q_lin
    return {"linear_ms": round(q_lin, 3), "unquantized_linear_ms": round(b_lin, 3),
            "speedup": round(b_step / q_step, 4),
            "speedup_linears_free": round(b_step / q_rest, 4),
            "speedup_linears_2x_unquantized": round(b_step / (q_rest + b_lin / 2), 4)}


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
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts a step (default: max_num_batched_tokens / input_len)")
    ap.add_argument("--steps", type=int, default=4, help="profiled steps per engine")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # one thread: the step's CPU time is then this thread's, which a loaded host does not
    # stretch as it does the wall clock (the caller's count restored at the end: a compile
    # cache key read later in the process includes it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base_args = EngineArgs(model=args.model, dtype=args.dtype, seed=args.seed,
                           enable_prefix_caching=False)
    quant_args = dataclasses.replace(base_args, quantization=args.quantization,
                                     quantization_rotation=args.quantization_rotation)
    # in this process: the steps run on this thread, whose CPU time is the step's
    engines = {"unquantized": LLMEngine(base_args.create_kiln_config(), multiprocess=False),
               args.quantization: LLMEngine(quant_args.create_kiln_config(), multiprocess=False)}
    try:
        torch.set_num_threads(1)  # the workers bound theirs while building
        cfg = engines["unquantized"].kiln_config
        batched = cfg.scheduler_config.max_num_batched_tokens
        n = args.num_prompts or max(1, batched // args.input_len)
        hf = cfg.model_config.hf_config
        dims = model_dims(getattr(hf, "text_config", hf))
        rng = random.Random(args.seed)
        steps = {k: [] for k in engines}
        cpus = {k: [] for k in engines}
        for r in range(args.steps + 1):  # the first round warms up
            prompts = [[rng.randrange(1000, dims["vocab"] - 1) for _ in range(args.input_len)]
                       for _ in range(n)]
            for name, engine in engines.items():
                _, step_cpu, _ = prefill_step(engine, prompts, f"{name}-t{r}", False)
                wall_p, cpu_p, events = prefill_step(
                    engine, [[t + 1 for t in p] for p in prompts], f"{name}-p{r}", True)
                if r:
                    cpus[name].append(step_cpu)
                    # the profiler times ops by the wall clock, which a loaded host stretches:
                    # ms of the step's CPU time, in the profiled step's proportions
                    scale = cpu_p / wall_p / 1000
                    steps[name].append({c: us * scale
                                        for c, us in attribute(events, dims).items()})
        rotation = engines[args.quantization].kiln_config.model_config.quantization_rotation
        report = {**cpu(), "model": cfg.model_config.model, "dtype": args.dtype,
                  "quantization_rotation": rotation, "rows_per_step": n * args.input_len,
                  "max_num_batched_tokens": batched,
                  "threads": torch.get_num_threads(), "steps": args.steps,
                  "load_avg": os.getloadavg()}
        for name in engines:
            report[name] = summarize(steps[name], cpus[name])
        report["ceilings"] = ceilings(report[args.quantization], report["unquantized"],
                                      ("qkv", "o", "gate_up", "down"))
    finally:
        for engine in engines.values():
            engine.shutdown()
        torch.set_num_threads(threads)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
