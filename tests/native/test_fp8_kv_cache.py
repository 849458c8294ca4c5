"""The CPU kernels over an fp8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2): their cache write
rounds K/V exactly as the torch path's (saturated, to nearest even), and each read path (the
per-token kernel, the blocked prefill kernel's AMX / AVX512 / portable paths, the layer call on a
mixed step) attends over the fp8 values as a float64 softmax over the same cache does."""
import random

import pytest
import torch
from paged_reference import reference_attention, shuffled_block_tables

from kiln.attention.cpu_backend import CpuAttentionImpl
from kiln.attention.kv_cache_dtype import to_cache
from kiln.attention.metadata import AttentionMetadata
from kiln.attention.torch_backend import TorchAttentionImpl, write_kv_cache
from kiln.native import paged_attention as pa
from kiln.native import prefill_attention as pf

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_cache_write_rounds_as_torch(dtype, kv_dtype):
    # normals, subnormals, ties, overflows (saturated), zeros of both signs
    top = torch.finfo(kv_dtype)
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(300, generator=g) * 4, torch.randn(100, generator=g) * 1e-3,
                        torch.randn(100, generator=g) * top.tiny, torch.tensor(
                            [0.0, -0.0, 1e6, -1e6, top.max, -top.max, top.max * 1.05,
                             1.0625, 1.1875, 3 * top.tiny / 8, 2 ** -10, 2 ** -17])])
    nkv, hd = 2, 16
    x = values[:values.numel() // (nkv * hd) * nkv * hd].to(dtype).view(-1, nkv * hd)
    n = x.shape[0]
    got = torch.zeros(2, n, 1, nkv, hd, dtype=kv_dtype)
    want = got.clone()
    slots = torch.randperm(n, generator=g)
    step = pa.StepArgs(torch.zeros(1, n, dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                       torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0,
                       1, slots, n)
    pa.run(x, x, x, torch.empty_like(x), got, step, 1.0)
    write_kv_cache(x.view(n, nkv, hd), x.view(n, nkv, hd), want, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(want[0].view(n, -1)[slots].float(), to_cache(x, kv_dtype).float())
    assert not want.float().isnan().any()  # saturated, never NaN


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_rounds_every_boundary_as_torch(dtype, kv_dtype):
    # Every bfloat16 (each fp8 value, tie and subnormal step is one; NaNs, infinities, zeros) and,
    # in float32, the values one step either side of it: the AVX512 write (16 at a time) and the
    # scalar tail give torch's bytes
    words = torch.arange(1 << 16, dtype=torch.int32) << 16
    if dtype == torch.float32:
        words = torch.stack([words - 1, words, words + 1], 1).flatten()
    x = (words.view(torch.float32) if dtype == torch.float32
         else (words >> 16).to(torch.int16).view(torch.bfloat16))
    hd = 48  # 3 SIMD steps a row, and rows of 2 heads leave no tail; 40 leaves one of 8
    for width in (2 * hd, 40):
        n = x.numel() // width
        rows = x[:n * width].view(n, width)
        got = torch.zeros(2, n, 1, 1, width, dtype=kv_dtype)
        step = pa.StepArgs(torch.zeros(1, n, dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                           torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                           0, 1, torch.arange(n), n)
        pa.run(rows, rows, rows, torch.empty_like(rows), got, step, 1.0)
        want = to_cache(rows, kv_dtype)
        nan = want.float().isnan()  # the sign of a NaN is torch's own (a bfloat16 +NaN: -NaN)
        for half in got:
            half = half.view(n, width)
            assert torch.equal(half.float().isnan(), nan), width
            assert torch.equal(half.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), width


def _fp8_step(bs, hd, nh, nkv, q_lens, ctx, dtype, kv_dtype, seed):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    tables, block_table, num_blocks = shuffled_block_tables(seq_lens, bs, rnd)
    kv = torch.zeros((2, num_blocks, bs, nkv, hd), dtype=kv_dtype)
    for r, table in enumerate(tables):
        for s in range(ctx[r]):
            kv[:, table[s // bs], s % bs] = to_cache(torch.randn(2, nkv, hd, generator=g) * 3,
                                                     kv_dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = torch.tensor([tables[r][p // bs] * bs + p % bs for r in range(len(q_lens))
                          for p in range(ctx[r], seq_lens[r])], dtype=torch.int64)
    qkv = (torch.randn(starts[-1], (nh + 2 * nkv) * hd + 3, generator=g) * 3).to(dtype)[:, 3:]
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
    loc, lens = (torch.tensor(t, dtype=torch.int32) for t in (starts, seq_lens))
    md = AttentionMetadata(starts[-1], len(q_lens), max(q_lens), max(seq_lens), loc, lens,
                           block_table, slots, loc, lens)
    return q, k, v, kv, md, tables, starts, seq_lens


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_over_an_fp8_cache_matches_the_reference_and_the_torch_path(dtype, kv_dtype):
    # decodes (one long enough for the split-keys path), a chunk over a cached prefix, a fresh
    # prefill and a long one: the per-token kernel and the blocked one
    bs, hd, nh, nkv = 16, 64, 8, 2
    q_lens, ctx = [1, 1, 5, 40, 9], [300, 0, 33, 0, bs + 1]
    q, k, v, kv, md, tables, starts, seq_lens = _fp8_step(bs, hd, nh, nkv, q_lens, ctx, dtype,
                                                          kv_dtype, 1)
    kv_torch = kv.clone()
    out = torch.full((starts[-1], nh * hd), 7.0, dtype=dtype)
    CpuAttentionImpl(nh, hd, hd ** -0.5, nkv).forward(q, k, v, kv, md, out)
    want = reference_attention(q, kv[0], kv[1], tables, starts, seq_lens, nh, nkv, hd, bs,
                               hd ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    worst = max(float((out[t].double() - row).abs().max() / max(1.0, row.abs().max()))
                for t, row in want.items())
    assert worst <= tol
    # the torch path (CUDA's, and the CPU's fallback) writes the same bytes and attends alike
    out_torch = torch.full_like(out, 7.0)
    TorchAttentionImpl(nh, hd, hd ** -0.5, nkv).forward(q, k, v, kv_torch, md, out_torch)
    assert torch.equal(kv_torch.view(torch.uint8), kv.view(torch.uint8))
    torch.testing.assert_close(out_torch.float(), out.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("path", list(pf.PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_prefill_path_reads_an_fp8_cache(path, dtype):
    _prefill_over_fp8(path, dtype, 6, 2, [37, 20], [45, 0])


@pytest.mark.parametrize("path", ["best", "avx512"])
def test_long_prefills_over_an_fp8_cache_take_units_of_4_lanes(path):
    # over an fp8 cache a unit takes as many 16-token lanes as the longest query fills (up to 4,
    # the key blocks' dequantization shared): 9 heads over 3 (1 lane over a bfloat16 cache), a
    # query of 70 (units of 64 and 6) and one of 5 beside it
    for dtype in (torch.float32, torch.bfloat16):
        _prefill_over_fp8(path, dtype, 9, 3, [70, 5], [30, 50])


@pytest.mark.parametrize("path", ["best", "avx512"])
def test_long_prefills_over_an_fp8_cache_dequantize_their_gathered_keys_once(path):
    # queries of over 32 tokens over 256 keys or more: bfloat16 queries' keys gathered (and
    # dequantized) once a call, units of 1 lane
    for dtype in (torch.float32, torch.bfloat16):
        _prefill_over_fp8(path, dtype, 9, 3, [100, 40], [200, 300])


def _prefill_over_fp8(path, dtype, nh, nkv, q_lens, ctx):
    bs, hd = 16, 64
    for kv_dtype in FP8:
        q, _, _, kv, md, tables, starts, seq_lens = _fp8_step(bs, hd, nh, nkv, q_lens, ctx,
                                                              dtype, kv_dtype, 2)
        for r, table in enumerate(tables):  # the queries' own keys, as a step has written them
            for s in range(ctx[r], seq_lens[r]):
                kv[:, table[s // bs], s % bs] = to_cache(torch.randn(2, nkv, hd) * 3, kv_dtype)
        step = pa.StepArgs(md.block_table, md.query_start_loc, md.seq_lens,
                           torch.tensor([0, 1], dtype=torch.int32), md.max_seq_len, bs,
                           torch.zeros(0, dtype=torch.int64), 0)
        out = torch.full((starts[-1], nh * hd), 7.0, dtype=dtype)
        pf.run(q, out, kv, step, hd ** -0.5, path=path)
        want = reference_attention(q, kv[0], kv[1], tables, starts, seq_lens, nh, nkv, hd, bs,
                                   hd ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        worst = max(float((out[t].double() - row).abs().max() / max(1.0, row.abs().max()))
                    for t, row in want.items())
        assert worst <= tol, (kv_dtype, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32 FMAs, BF16 dots
@pytest.mark.parametrize("kv_dtype", FP8)
def test_a_nan_in_the_cache_stays_nan_in_the_decode_kernel(kv_dtype, dtype):
    # A NaN K/V (a diverged model) is stored as the format's NaN, not saturated: decoding over
    # it gives NaN, as over an "auto" cache and on the torch path (the AVX512 e4m3 load read it
    # as 480, a finite answer); the other request is untouched
    bs, hd, nh, nkv = 16, 64, 4, 2
    for which in (0, 1):  # K, V
        q, k, v, kv, md, tables, starts, _ = _fp8_step(bs, hd, nh, nkv, [1, 1], [40, 20],
                                                       dtype, kv_dtype, 3)
        kv[which, tables[0][0], 3, 0, 5] = float("nan")
        kv_torch = kv.clone()
        out, out_torch = (torch.zeros(starts[-1], nh * hd, dtype=dtype) for _ in range(2))
        CpuAttentionImpl(nh, hd, hd ** -0.5, nkv).forward(q, k, v, kv, md, out)
        TorchAttentionImpl(nh, hd, hd ** -0.5, nkv).forward(q, k, v, kv_torch, md, out_torch)
        assert out_torch[0].isnan().any() and not out_torch[1].isnan().any()
        assert torch.equal(out.isnan().any(1), out_torch.isnan().any(1)), "KV"[which]


def test_bfloat16_queries_over_an_fp8_cache_take_the_bf16_dot_products():
    # the key rows converted to bfloat16 (exact) for VDPBF16PS where a bfloat16 cache takes it:
    # the float32 FMA path converted each row once per query head (2x a bfloat16 cache's time)
    for kv_dtype in FP8:
        for hd in (64, 80, 128):
            assert pa.bf16_dot(kv_dtype, hd) == pa.bf16_dot(torch.bfloat16, hd), (kv_dtype, hd)


# A checkpoint's per-layer scales (kiln/attention/kv_cache_scales.py): K/V stored / scale, read
# back * scale; the kernels fold k_scale into the scores' scale and v_scale into the outputs'.
K_SCALE, V_SCALE = 0.37, 3.1


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scaled_write_stores_torchs_to_cache_of_x_over_the_scale(dtype, kv_dtype):
    g = torch.Generator().manual_seed(4)
    top = torch.finfo(kv_dtype).max
    # 16 at a time and a tail of 8; past the scaled saturation point too
    x = torch.cat([torch.randn(50 * 40, generator=g) * 4, torch.randn(40, generator=g) * top])
    x = x.to(dtype).view(-1, 40)
    n = x.shape[0]
    got = torch.zeros(2, n, 1, 1, 40, dtype=kv_dtype)
    want = got.clone()
    slots = torch.randperm(n, generator=g)
    step = pa.StepArgs(torch.zeros(1, n, dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                       torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0,
                       1, slots, n)
    pa.run(x, x, x, torch.empty_like(x), got, step, 1.0, k_scale=K_SCALE, v_scale=V_SCALE)
    write_kv_cache(x.view(n, 1, 40), x.view(n, 1, 40), want, slots, None, K_SCALE, V_SCALE)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    for half, scale in zip(want, (K_SCALE, V_SCALE)):
        stored = half.view(n, -1)[slots]
        assert torch.equal(stored.view(torch.uint8),
                           to_cache(x.float() / scale, kv_dtype).view(torch.uint8))
    unscaled = torch.zeros_like(got)
    pa.run(x, x, x, torch.empty_like(x), unscaled, step, 1.0)
    assert not torch.equal(unscaled[0].view(torch.uint8), got[0].view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_over_a_scaled_fp8_cache_matches_the_reference_and_the_torch_path(
        dtype, kv_dtype):
    bs, hd, nh, nkv = 16, 64, 8, 2
    q_lens, ctx = [1, 1, 5, 40, 9], [300, 0, 33, 0, bs + 1]
    q, k, v, kv, md, tables, starts, seq_lens = _fp8_step(bs, hd, nh, nkv, q_lens, ctx, dtype,
                                                          kv_dtype, 5)
    kv_torch = kv.clone()
    impls = [cls(nh, hd, hd ** -0.5, nkv) for cls in (CpuAttentionImpl, TorchAttentionImpl)]
    for impl in impls:
        impl.k_scale, impl.v_scale = K_SCALE, V_SCALE
    out, out_torch = (torch.full((starts[-1], nh * hd), 7.0, dtype=dtype) for _ in range(2))
    impls[0].forward(q, k, v, kv, md, out)
    impls[1].forward(q, k, v, kv_torch, md, out_torch)
    assert torch.equal(kv_torch.view(torch.uint8), kv.view(torch.uint8))
    want = reference_attention(q, kv[0].double() * K_SCALE, kv[1].double() * V_SCALE, tables,
                               starts, seq_lens, nh, nkv, hd, bs, hd ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for got in (out, out_torch):
        worst = max(float((got[t].double() - row).abs().max() / max(1.0, row.abs().max()))
                    for t, row in want.items())
        assert worst <= tol * V_SCALE
    torch.testing.assert_close(out_torch.float(), out.float(), rtol=tol, atol=tol * 4 * V_SCALE)


@pytest.mark.parametrize("q_lens, ctx", [([37, 20], [45, 0]), ([40, 100], [260, 200])])
@pytest.mark.parametrize("path", list(pf.PATHS))
def test_each_prefill_path_reads_a_scaled_fp8_cache(path, q_lens, ctx):
    bs, hd, nh, nkv = 16, 64, 6, 2
    for dtype in (torch.float32, torch.bfloat16):
        q, _, _, kv, md, tables, starts, seq_lens = _fp8_step(bs, hd, nh, nkv, q_lens, ctx,
                                                              dtype, torch.float8_e4m3fn, 6)
        step = pa.StepArgs(md.block_table, md.query_start_loc, md.seq_lens,
                           torch.tensor([0, 1], dtype=torch.int32), md.max_seq_len, bs,
                           torch.zeros(0, dtype=torch.int64), 0)
        out = torch.full((starts[-1], nh * hd), 7.0, dtype=dtype)
        pf.run(q, out, kv, step, hd ** -0.5, path=path, k_scale=K_SCALE, v_scale=V_SCALE)
        want = reference_attention(q, kv[0].double() * K_SCALE, kv[1].double() * V_SCALE,
                                   tables, starts, seq_lens, nh, nkv, hd, bs, hd ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        worst = max(float((out[t].double() - row).abs().max() / max(1.0, row.abs().max()))
                    for t, row in want.items())
        assert worst <= tol * V_SCALE, (dtype, worst)


def test_the_kernels_refuse_a_scale_that_is_not_finite_and_positive():
    kv = torch.zeros(2, 1, 16, 1, 64, dtype=torch.float8_e4m3fn)
    x = torch.zeros(1, 64)
    step = pa.StepArgs(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                       torch.tensor([1], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1,
                       16, torch.zeros(1, dtype=torch.int64), 1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale and v_scale must be finite and > 0"):
            pa.run(x, x, x, torch.empty_like(x), kv, step, 1.0, v_scale=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_in_the_model_dtype_ignores_the_scales_on_both_paths(dtype):
    # K/V stored as they are ("auto"): the scales only mean something to an fp8 cache
    bs, hd, nh, nkv = 16, 64, 4, 2
    q, k, v, _, md, _, starts, _ = _fp8_step(bs, hd, nh, nkv, [1, 12], [20, 0], dtype,
                                             torch.float8_e4m3fn, 7)
    outs, caches = [], []
    for cls in (CpuAttentionImpl, TorchAttentionImpl):
        for scales in ((1.0, 1.0), (K_SCALE, V_SCALE)):
            impl = cls(nh, hd, hd ** -0.5, nkv)
            impl.k_scale, impl.v_scale = scales
            kv = torch.zeros(2, md.block_table.max() + 1, bs, nkv, hd, dtype=dtype)
            out = torch.zeros(starts[-1], nh * hd, dtype=dtype)
            impl.forward(q, k, v, kv, md, out)
            outs.append(out)
            caches.append(kv)
    for i in (1, 3):
        assert torch.equal(caches[i], caches[i - 1]) and torch.equal(outs[i], outs[i - 1])
