"""Child process of test_isa_tiers.py: builds the CPU kernels with extra compile flags (a CPU below
this one: -march=native with features turned off), loads them (a process loads one library,
so a child) and checks what that CPU runs against the references (layer ops, int8, MoE experts,
the sampler's draw, attention). Prints one JSON line: what the library was built with, and every
mismatch found (none expected).

Usage: KILN_NATIVE_CFLAGS="FLAG ..." python _tier_child.py
"""
import json
import random

import torch
from paged_reference import reference_attention, shuffled_block_tables

from kiln import ir
from kiln.native import build

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def close(got, want, dtype, roundings: int = 1) -> bool:
    """Within the layer-op tests' tolerance (tests/model/test_ir_ops.py) for bfloat16 results
    `roundings` bfloat16 steps deep, NaN where NaN."""
    got, want = got.float(), want.float()
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return False
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2 ** -7 * roundings, 1e-2)
    return torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


def layer_ops(g: torch.Generator) -> None:
    from kiln.ir import layer_ops as ref
    k = torch.ops.kiln
    for dtype in (torch.float32, torch.bfloat16):
        for rows, hidden in [(1, 64), (3, 31), (65, 130), (257, 576), (2, 1)]:
            tag = f"{dtype} {rows}x{hidden}"
            x = torch.randn(rows, hidden + 3, generator=g).to(dtype)[:, 3:]  # strided, offset
            res, w = torch.randn(rows, hidden, generator=g).to(dtype), torch.randn(hidden).to(dtype)
            check(close(k.rms_norm_native(x, w, 1e-6), ref._rms_norm_ref(x, w, 1e-6), dtype),
                  f"rms_norm {tag}")
            (got, total), (want, want_total) = (k.fused_add_rms_norm_native(x, res, w, 1e-6),
                                                ref._fused_add_rms_norm_ref(x, res, w, 1e-6))
            check(close(got, want, dtype) and torch.equal(total, want_total),
                  f"fused_add_rms_norm {tag}")
            if hidden % 2 == 0:
                # two roundings: silu's, then the product's. The portable path's expf is a bit
                # off torch's (a vector expf and Sleef's): a silu that lands on a bfloat16 tie
                # rounds the other way, and the product takes that step on
                check(close(k.silu_and_mul_native(x * 4), ref._silu_and_mul_ref(x * 4), dtype, 2),
                      f"silu_and_mul {tag}")
            # layer_norm.c: LayerNorm (bias, residual add) and GELU's tanh form
            b = torch.randn(hidden, generator=g).to(dtype)
            check(close(k.layer_norm_native(x, w, b, 1e-5), ir.layer_norm.reference(x, w, b, 1e-5),
                        dtype), f"layer_norm {tag}")
            (got, total), (want, want_total) = (
                k.fused_add_layer_norm_native(x, res, w, None, 1e-5),
                ir.fused_add_layer_norm.reference(x, res, w, None, 1e-5))
            check(close(got, want, dtype) and torch.equal(total, want_total),
                  f"fused_add_layer_norm {tag}")
            check(close(k.gelu_native(x * 4, "tanh"), ir.gelu.reference(x * 4, "tanh"), dtype),
                  f"gelu tanh {tag}")
        # a row whose squares overflow is 0 (torch's rsqrt(inf)), also where x * w overflows
        x, w = torch.tensor([[1.0, 3e38, -2.0]]).to(dtype), torch.tensor([-1.5, 2.0, 3.0]).to(dtype)
        check(close(k.rms_norm_native(x, w, 1e-6), ref._rms_norm_ref(x, w, 1e-6), dtype),
              f"rms_norm {dtype} of a row whose squares overflow")
        for hd, nq, nk, neox in [(64, 4, 2, True), (80, 3, 1, False), (128, 2, 2, True)]:
            pos = torch.randint(0, 50, (9,), generator=g)
            q, kk = (torch.randn(9, n * hd, generator=g).to(dtype) for n in (nq, nk))
            cache = torch.randn(50, hd, generator=g)
            got = k.rotary_embedding_native(pos, q, kk, cache, hd, neox)
            want = ref._rotary_ref(pos, q, kk, cache, hd, neox)
            # bit for bit: each product rounded, then the sum, as torch's ops (no FMA)
            check(all(torch.equal(a, b) for a, b in zip(got, want)), f"rotary {dtype} hd {hd}")
    rotary_bits(g)


def rotary_bits(g: torch.Generator) -> None:
    """test_rotary_kernel.py's cases, fewer: this CPU's path (the bit trick without
    AVX512-BF16, the portable loop without AVX-512) bit for bit against the same replay."""
    import rotary_reference as rr
    for dtype in (torch.float32, torch.bfloat16):
        for neox in (True, False):
            for in_place, (tokens, hd, nq, nk) in [(True, (7, 80, 3, 1)), (False, (67, 64, 2, 1)),
                                                   (True, (3, 6, 1, 1))]:
                for inputs in rr.INPUTS:
                    (gq, gk), (wq, wk) = rr.run_case(g, dtype, neox, in_place, tokens, hd, nq, nk,
                                                     inputs)
                    check(rr.same_bits(gq, wq) and rr.same_bits(gk, wk),
                          f"rotary bits {dtype} neox {neox} hd {hd} {inputs}")


def int8_ops(g: torch.Generator) -> None:
    from kiln.ir import int8_panels
    from kiln.ir import quant as ref
    k = torch.ops.kiln
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(70, 130, generator=g).to(dtype)
        x[3] = 0
        q, s = k.dynamic_int8_quant_native(x)
        rq, rs = ref._dynamic_int8_quant_ref(x)
        check(torch.equal(q, rq) and torch.equal(s, rs), f"dynamic_int8_quant {dtype}")
        # every row count either side of the GEMM's paths (VNNI, oneDNN, panels)
        for m in (1, 15, 16, 63, 64, 65, 1024, 1025):
            for kdim, n in [(1, 13), (5, 96), (64, 13), (132, 96)]:
                tag = f"{dtype} m {m} k {kdim} n {n}"
                a = torch.randint(-128, 128, (m, kdim), dtype=torch.int8, generator=g)
                w = torch.randint(-128, 128, (n, kdim), dtype=torch.int8, generator=g)
                sa, sw = torch.rand(m, 1, generator=g), torch.rand(n, generator=g) / 100
                bias = torch.randn(n, generator=g).to(dtype)
                want = ref._int8_scaled_mm_ref(a, sa, w, sw, bias, dtype)
                check(torch.equal(k.int8_scaled_mm_native(a, sa, w, sw, bias, dtype), want),
                      f"int8_scaled_mm {tag}")
                if kdim % 4:
                    continue
                panels = int8_panels.pack_int8_panels(w)
                check(torch.equal(k.int8_scaled_mm_panels_native(a, sa, panels, sw, bias, dtype),
                                  want), f"int8_scaled_mm_panels {tag}")
                if n % 2:
                    continue
                got = k.int8_scaled_mm_panels_silu_quant_native(a, sa, panels, sw, bias, dtype)
                unfused = k.silu_and_mul_dynamic_int8_quant_native(want)
                check(all(torch.equal(u, v) for u, v in zip(got, unfused)),
                      f"int8_scaled_mm_panels_silu_quant {tag}")


def moe(g: torch.Generator) -> None:
    """The float experts kernel (csrc/moe_experts.cpp: GEMV and SiLU-and-mul of this tier, aten's
    GEMM where no AMX tiles) against the reference, as tests/model/test_moe_native.py does."""
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, k in [(1, 2), (3, 8), (40, 2)]:
            x = torch.randn(tokens, 64, generator=g).to(dtype)
            w13, w2 = (torch.randn(*s, generator=g).mul(0.2).to(dtype)
                       for s in ((10, 96, 64), (10, 64, 48)))
            ids = torch.stack([torch.randperm(10, generator=g)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, generator=g)
            got = torch.ops.kiln.fused_experts_native(x, weights, ids, w13, w2)
            want = ir.fused_moe.reference(x, x.new_empty(tokens, 10), w13, w2, k, False,
                                          weights, ids)
            # float32: the GEMMs' summation order apart (test_moe_native.py's tolerance)
            ok = (close(got, want, dtype, 2) if dtype == torch.bfloat16
                  else torch.allclose(got, want, rtol=1e-5, atol=1e-5))
            check(ok, f"fused_experts {dtype} T {tokens} k {k}")
    rows_gemm(g)


def rows_gemm(g: torch.Generator) -> None:
    """csrc/rows_gemm.c of this tier (AVX-512F FMA, bfloat16 widened, where no AVX512-BF16)
    alone at odd sizes, NaN and infinity, and as the experts' route, as
    tests/native/test_rows_gemm.py and test_moe_native.py check this machine's."""
    k = torch.ops.kiln
    for dtype in (torch.float32, torch.bfloat16):
        if k.fused_experts_rows_isa(build.DTYPES[dtype]) == 0:
            continue
        for m, n, kd in [(1, 5, 7), (3, 37, 33), (5, 96, 64), (9, 33, 17), (17, 130, 257)]:
            x, w = (torch.randn(r, kd, generator=g).to(dtype) for r in (m, n))
            x[m - 1, kd // 2] = float("inf")
            w[n // 2, 0] = float("nan")
            got, want = k.rows_gemm_native(x, w), x @ w.t()
            ok = (close(got, want, dtype, 2) if dtype == torch.bfloat16
                  else torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True))
            check(ok and torch.equal(got.isinf(), want.isinf()), f"rows_gemm {dtype} {m}x{n}x{kd}")
        # 9 rows to expert 0, 3 to each of 1..3, one to 4: the route counts say the kernel ran
        ids = torch.tensor([[0, 1 + i % 3] for i in range(9)] + [[4, 5]])
        x = torch.randn(len(ids), 80, generator=g).to(dtype)
        w13, w2 = (torch.randn(*s, generator=g).mul(0.2).to(dtype)
                   for s in ((6, 80, 80), (6, 80, 40)))
        weights = torch.rand(len(ids), 2, generator=g)
        before = k.fused_experts_route_counts()
        got = k.fused_experts_native(x, weights, ids, w13, w2)
        ran = [a - b for a, b in zip(k.fused_experts_route_counts(), before)]
        want = ir.fused_moe.reference(x, x.new_empty(len(ids), 6), w13, w2, 2, False, weights, ids)
        ok = (close(got, want, dtype, 2) if dtype == torch.bfloat16
              else torch.allclose(got, want, rtol=1e-5, atol=1e-5))
        check(ok and ran[3] >= 1, f"fused_experts on rows_gemm {dtype}: routes {ran}")


def sample(g: torch.Generator) -> None:
    """The sampler's fused draw (csrc/sample_rows.c: this tier's e^x) against inverse_cdf over
    the softmax, as tests/sample/test_sample_rows.py does."""
    from kiln.sample.inverse_cdf import inverse_cdf
    for vocab in (1, 255, 257, 5000):
        x = torch.randn(32, vocab, generator=g) * 4
        x[:, 1::3] = float("-inf")
        scale = torch.rand(32, generator=g) + 0.5
        u = torch.rand(32, dtype=torch.float64, generator=g)
        got = torch.ops.kiln.sample_rows_native(x, scale, u)
        check(torch.equal(got, inverse_cdf((x * scale[:, None]).softmax(dim=1), u)),
              f"sample_rows vocab {vocab}")


def moe_int8(g: torch.Generator, isa) -> None:
    """The int8 experts kernel (csrc/moe_experts_int8.cpp) on this tier's int8 kernels, experts of
    0, 1, 12, 13 and 26 rows, as stored and packed: bit for bit the reference in bfloat16 (as
    tests/model/test_moe_native.py). Without AVX512-VNNI it refuses, naming why."""
    from kiln.ir.moe_int8_panels import pack_expert_panels
    w13 = torch.randint(-128, 128, (6, 96, 64), dtype=torch.int8, generator=g)
    w2 = torch.randint(-128, 128, (6, 64, 48), dtype=torch.int8, generator=g)
    s13, s2 = torch.rand(6, 96, generator=g) / 500, torch.rand(6, 64, generator=g) / 500
    chosen = torch.tensor([1] + [2] * 12 + [3] * 13)
    ids = torch.stack([chosen, torch.full_like(chosen, 4)], 1)
    ids[::3] = ids[::3].flip(1)
    weights = torch.rand(len(chosen), 2, generator=g)
    x = torch.randn(len(chosen), 64, generator=g).to(torch.bfloat16)
    if isa is None:
        try:
            torch.ops.kiln.fused_experts_int8_native(x, weights, ids, w13, s13, w2, s2, False)
            check(False, "fused_experts_int8 ran without AVX512-VNNI")
        except RuntimeError as e:
            check("without AVX512-VNNI" in str(e), f"fused_experts_int8 refusal: {e}")
        return
    want = ir.fused_moe_int8.reference(x, x.new_empty(len(chosen), 6), w13, s13, w2, s2, 2,
                                       False, weights, ids)
    for packed, a, b in ((False, w13, w2), (True, pack_expert_panels(w13), pack_expert_panels(w2))):
        got = torch.ops.kiln.fused_experts_int8_native(x, weights, ids, a, s13, b, s2, packed)
        check(torch.equal(got, want), f"fused_experts_int8 packed={packed}")


def attention(g: torch.Generator) -> None:
    """The CPU backend's layer call on a mixed step (decodes, a chunk over a cached prefix, a
    fresh prefill and a long one: the per-token kernel, the blocked one or SDPA) against a
    float64 softmax, as tests/native/test_fuzz_attention.py does; over the model's dtype and
    over fp8 caches (--kv-cache-dtype: this tier's fp8 loads and cache write)."""
    from kiln.attention.cpu_backend import CpuAttentionImpl
    from kiln.attention.kv_cache_dtype import to_cache
    from kiln.attention.metadata import AttentionMetadata
    rnd = random.Random(0)
    for dtype, kv_dtype in [(d, kd) for d in (torch.float32, torch.bfloat16)
                            for kd in (d, torch.float8_e4m3fn, torch.float8_e5m2)]:
        for bs, hd, nh, nkv in [(16, 64, 8, 2), (3, 80, 7, 1), (32, 128, 4, 4)]:
            q_lens, ctx = [1, 1, 5, 40, 9], [17, 0, 33, 0, bs + 1]
            seq_lens = [c + n for c, n in zip(ctx, q_lens)]
            tables, block_table, num_blocks = shuffled_block_tables(seq_lens, bs, rnd)
            kv = torch.full((2, num_blocks, bs, nkv, hd), float("nan"), dtype=kv_dtype)
            for r, table in enumerate(tables):
                for p in range(ctx[r]):
                    kv[:, table[p // bs], p % bs] = to_cache(
                        torch.randn(2, nkv, hd, generator=g).to(dtype), kv_dtype)
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            slots = torch.tensor([tables[r][p // bs] * bs + p % bs for r in range(len(q_lens))
                                  for p in range(ctx[r], seq_lens[r])], dtype=torch.int64)
            qkv = torch.randn(starts[-1], (nh + 2 * nkv) * hd + 3, generator=g).to(dtype)[:, 3:]
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
            out = torch.full((starts[-1], nh * hd), 7.0, dtype=dtype)
            loc, lens = (torch.tensor(t, dtype=torch.int32) for t in (starts, seq_lens))
            md = AttentionMetadata(starts[-1], len(q_lens), max(q_lens), max(seq_lens), loc,
                                   lens, block_table, slots, loc, lens)
            CpuAttentionImpl(nh, hd, hd ** -0.5, nkv).forward(q, k, v, kv, md, out)
            written = kv.view(2, -1, nkv * hd)[:, slots]  # the step's k, v as the cache holds them
            check(torch.equal(written.view(torch.uint8), torch.stack(
                [to_cache(k, kv_dtype), to_cache(v, kv_dtype)]).view(torch.uint8)),
                f"cache write {dtype} into {kv_dtype} hd {hd}")
            want = reference_attention(q, kv[0], kv[1], tables, starts, seq_lens, nh, nkv, hd, bs,
                                       hd ** -0.5)
            tol = 1e-5 if dtype == torch.float32 else 2 ** -6
            worst = max(float((out[t].double() - row).abs().max() / max(1.0, row.abs().max()))
                        for t, row in want.items())
            check(worst <= tol, f"attention {dtype} over {kv_dtype} bs {bs} hd {hd}: off by "
                  f"{worst:.2e}")


if __name__ == "__main__":
    assert build.available(), "the kernels did not build with " + " ".join(build.cflags())
    from kiln.native import gguf_matmul, paged_attention, prefill_attention
    from kiln.native import int8_ops as native_int8
    g = torch.Generator().manual_seed(0)
    torch.set_num_threads(2)
    layer_ops(g)
    isa = native_int8.isa()
    if isa is not None:
        int8_ops(g)
    moe(g)
    sample(g)
    moe_int8(g, isa)
    attention(g)
    chosen = ir.resolve({}, "cpu", torch.bfloat16).as_dict()
    print(json.dumps({
        "library": str(build._loaded), "int8_isa": isa, "amx_min_rows": native_int8.amx_min_rows(),
        "onednn_min_rows": native_int8.onednn_min_rows(),
        "gguf_kernel": gguf_matmul.kernel_available(),
        "prefill_simd": [prefill_attention.simd(d, 128) for d in (torch.float32, torch.bfloat16)],
        "prefill_amx": prefill_attention.amx(torch.bfloat16, 128),
        "bf16_dot": paged_attention.bf16_dot(torch.bfloat16, 128),
        "moe_tiles": torch.ops.kiln.fused_experts_tiles(),
        "rows_isa": [torch.ops.kiln.fused_experts_rows_isa(d) for d in (0, 1)],
        "chosen": chosen, "failures": failures}))
