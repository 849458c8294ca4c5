"""The decode kernel's p . v for bfloat16 queries takes the softmax weights rounded to bfloat16
(VDPBF16PS, as HF's eager attention rounds them before its matmul with V): each weight is then
within 2^-8 of itself, and rounded to nearest, so the errors do not add up to a bias. Checked
against a float64 softmax over bfloat16 and fp8 caches, sharp and flat score distributions."""
import random

import pytest
import torch
from paged_reference import shuffled_block_tables

from kiln.native import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")

BS, HD, NH, NKV, CTX = 16, 64, 9, 3, 300  # the default model's heads, a decode's context
U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits, rounded to nearest)
KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def decode(kv_dtype, q_scale: float, v_mean: float, threads: int, seed: int, reqs: int = 4):
    """(the kernel's bfloat16 output [reqs, NH, HD] as float64, the float64 reference's, and
    A [reqs, NH, HD]: sum over keys of weight * |value|, what the weights' rounding can move)
    for a decode of `reqs` requests of CTX keys; queries N(0, q_scale) so the scores spread
    about as much (q_scale 8: scores up to ~25, a few keys weigh; 1: hundreds do)."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seq_lens = [CTX + 1] * reqs
    tables, block_table, num_blocks = shuffled_block_tables(seq_lens, BS, rnd)
    shape = (2, num_blocks, BS, NKV, HD)
    kv = torch.randn(shape, generator=g)
    kv[1] += v_mean
    kv = kv.to(kv_dtype)
    q = (torch.randn(reqs, NH * HD, generator=g) * q_scale).to(torch.bfloat16)
    k, v = (torch.randn(reqs, NKV * HD, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = [tables[r][CTX // BS] * BS + CTX % BS for r in range(reqs)]
    out = torch.zeros(reqs, NH * HD, dtype=torch.bfloat16)
    step = pa.StepArgs(block_table, torch.arange(reqs + 1, dtype=torch.int32),
                       torch.tensor(seq_lens, dtype=torch.int32),
                       torch.arange(reqs, dtype=torch.int32), CTX + 1, BS,
                       torch.tensor(slots, dtype=torch.int64), reqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pa.run(q, k, v, out, kv, step, HD ** -0.5)
    finally:
        torch.set_num_threads(before)
    want = torch.empty(reqs, NH, HD, dtype=torch.float64)
    spread = torch.empty_like(want)
    for r in range(reqs):  # the cache as the kernel read it (the step's own k/v written)
        idx = [tables[r][s // BS] * BS + s % BS for s in range(CTX + 1)]
        keys = kv[0].reshape(-1, NKV, HD)[idx].double().repeat_interleave(NH // NKV, 1)
        vals = kv[1].reshape(-1, NKV, HD)[idx].double().repeat_interleave(NH // NKV, 1)
        w = (torch.einsum("hd,nhd->hn", q[r].double().view(NH, HD), keys) * HD ** -0.5).softmax(-1)
        want[r] = torch.einsum("hn,nhd->hd", w, vals)
        spread[r] = torch.einsum("hn,nhd->hd", w, vals.abs())
    return out.double().view(reqs, NH, HD), want, spread


@pytest.mark.parametrize("threads", [1, 2])  # 2: one request's keys split in parts, merged
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_each_output_is_within_the_weights_and_its_own_rounding(kv_dtype, q_scale, threads):
    # weights rounded to bfloat16 (each within U of itself) move an output by at most U * A,
    # its own rounding by U of it. Rounding anything before e^x (a score of ~25 to bfloat16
    # moves its weight by up to 6%), or pairing a weight with another key's value, breaks it.
    out, want, spread = decode(kv_dtype, q_scale, 0.0, threads, seed=int(q_scale) + threads)
    bound = 1.01 * U * (spread + want.abs()) + 1e-6
    excess = ((out - want).abs() - bound).max().item()
    assert excess <= 0, excess


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_rounding_is_to_nearest_so_it_leaves_no_bias(kv_dtype):
    # Values around 3: weights truncated (each up to 2^-7 low, 2^-8.5 on average) would pull the
    # outputs ~0.3% low, within the bound above; to nearest their errors cancel, and the outputs'
    # mean relative error stays near 0 (measured <= 4e-5; the bound is 1/8 of truncation's pull).
    out, want, _ = decode(kv_dtype, 1.0, 3.0, 1, seed=11, reqs=8)
    bias = ((out - want) / want.abs()).mean().item()
    assert abs(bias) <= 2.0 ** -11.5, bias
