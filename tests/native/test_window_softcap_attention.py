"""Both CPU attention kernels (paged_attention.c for short queries, prefill_attention.c's three
paths for long ones) with a sliding window and Gemma-2's logit soft cap, against a float64
softmax over each query's window: windows shorter and longer than a key block, a window whose
decode still splits its keys across threads, lanes of one unit with different window starts."""
import random

import pytest
import torch
from paged_reference import reference_attention, shuffled_block_tables

from kiln.native import paged_attention as pa
from kiln.native import prefill_attention as pf

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")

# block size, head size, heads, kv heads, query lengths, cached context lengths, window, softcap
PREFILL = [(16, 64, 4, 2, [37, 50], [0, 45], 8, None), (16, 64, 2, 2, [70], [30], 5, 50.0),
           (4, 32, 8, 2, [40, 19], [3, 90], 33, 2.0)]
DECODE = [(16, 64, 4, 2, [1, 1, 3], [300, 5, 40], 8, None), (8, 64, 2, 2, [1], [600], 260, None),
          (4, 32, 6, 2, [1, 2], [70, 9], 16, 3.0), (16, 64, 4, 1, [1], [90], None, 0.5)]


def _case(case, dtype, decode: bool):
    """(q, k, v, kv cache, step, the reference rows): the cache holds every request's context
    (NaN in slots no request owns) and, for a prefill, its queries' K/V too; q/k/v are strided
    column slices of one fused qkv."""
    bs, hd, nh, nkv, q_lens, ctx, window, cap = (DECODE if decode else PREFILL)[case]
    rnd, g = random.Random(case), torch.Generator().manual_seed(case)
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    tables, block_table, num_blocks = shuffled_block_tables(seq_lens, bs, rnd)
    kv = torch.full((2, num_blocks, bs, nkv, hd), float("nan"), dtype=dtype)
    written = ctx if decode else seq_lens  # a decode's kernel writes its own K/V
    for r, table in enumerate(tables):
        for s in range(written[r]):
            kv[:, table[s // bs], s % bs] = torch.randn(2, nkv, hd, generator=g).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = [tables[r][p // bs] * bs + p % bs for r in range(len(q_lens))
             for p in range(ctx[r], seq_lens[r])] if decode else []
    qkv = torch.randn(starts[-1], (nh + 2 * nkv) * hd + 3, generator=g).to(dtype)[:, 3:]
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
    step = pa.StepArgs(block_table, torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(seq_lens, dtype=torch.int32),
                       torch.arange(len(q_lens), dtype=torch.int32), max(seq_lens), bs,
                       torch.tensor(slots, dtype=torch.int64), len(slots))
    return q, k, v, kv, step, (tables, starts, seq_lens, nh, nkv, hd, bs, window, cap)


def _check(out, kv, q, ref_args, dtype):
    tables, starts, seq_lens, nh, nkv, hd, bs, window, cap = ref_args
    want = reference_attention(q, kv[0], kv[1], tables, starts, seq_lens, nh, nkv, hd, bs,
                               hd ** -0.5, window=window, softcap=cap)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # as the kernels' own fuzz tests
    for t, row in want.items():
        assert (out[t].double() - row).abs().max() <= tol * max(1.0, row.abs().max()), t


@pytest.mark.parametrize("path", list(pf.PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_prefill_kernel_window_and_softcap(case, dtype, path):
    q, _, _, kv, step, ref = _case(case, dtype, decode=False)
    out = torch.full(q.shape, 7.0, dtype=dtype)
    pf.run(q, out, kv, step, ref[5] ** -0.5, path=path, window=ref[7], softcap=ref[8])
    _check(out, kv, q, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(DECODE)))
def test_paged_kernel_window_and_softcap(case, dtype):
    q, k, v, kv, step, ref = _case(case, dtype, decode=True)
    out = torch.full(q.shape, 7.0, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # case 1's one request then splits its window's keys in two
    try:
        pa.run(q, k, v, out, kv, step, ref[5] ** -0.5, ref[7], ref[8])
    finally:
        torch.set_num_threads(before)
    _check(out, kv, q, ref, dtype)
