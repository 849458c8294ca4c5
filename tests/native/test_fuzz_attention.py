"""The paged-attention C kernel (kiln/native/paged_attention.py) against a float64 softmax over
the gathered context: shuffled block tables, block sizes 1-32, odd head sizes and GQA ratios,
decodes mixed with chunks continuing a cached prefix, long contexts (split keys), strided q/k/v
slices of one fused qkv, and NaN in every cache slot no request owns."""
import random

import pytest
import torch
from paged_reference import reference_attention, shuffled_block_tables

from kiln.native import build
from kiln.native import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")

CASES = [  # block size, head size, heads, kv heads, query lengths, cached prefix lengths
    (1, 128, 4, 4, [1], [700]), (3, 80, 7, 1, [1, 1, 1], [0, 1, 2100]),
    (16, 64, 14, 2, [1, 5, 16], [15, 16, 17]), (32, 256, 8, 2, [16], [300]),
    (16, 72, 6, 3, [1, 1, 1, 1], [600, 1, 0, 128]), (16, 96, 4, 1, [1], [256]),
    (3, 32, 2, 1, [2, 1], [31, 32]), (16, 2, 2, 1, [1], [300]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_float64_softmax(case, threads, dtype):
    bs, hd, nh, nkv, q_lens, ctx = CASES[case]
    rnd, g = random.Random(case), torch.Generator().manual_seed(case)
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    tables, block_table, num_blocks = shuffled_block_tables(seq_lens, bs, rnd)
    shape = (num_blocks, bs, nkv, hd)
    kc, vc = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    for r, table in enumerate(tables):
        for s in range(ctx[r]):
            kc[table[s // bs], s % bs] = torch.randn(nkv, hd, generator=g).to(dtype)
            vc[table[s // bs], s % bs] = torch.randn(nkv, hd, generator=g).to(dtype)
    kv = torch.stack([kc, vc])  # the layer's cache [2, nb, bs, nkv, hd], as the op takes it
    kc, vc = kv[0], kv[1]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = [tables[r][p // bs] * bs + p % bs for r in range(len(q_lens))
             for p in range(ctx[r], seq_lens[r])]
    width = (nh + 2 * nkv) * hd
    qkv = torch.randn(starts[-1], width + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
    out = torch.full((starts[-1], nh * hd), 7.0, dtype=dtype)
    step = pa.StepArgs(block_table, torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(seq_lens, dtype=torch.int32),
                       torch.arange(len(q_lens), dtype=torch.int32), max(seq_lens), bs,
                       torch.tensor(slots, dtype=torch.int64), starts[-1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pa.run(q, k, v, out, kv, step, hd ** -0.5)
    finally:
        torch.set_num_threads(before)
    want = reference_attention(q, kc, vc, tables, starts, seq_lens, nh, nkv, hd, bs, hd ** -0.5)
    tol = 4e-6 if dtype == torch.float32 else 2 ** -6  # measured worst 1e-6 / 8e-3: rounding
    for t, row in want.items():
        assert (out[t].double() - row).abs().max() <= tol * max(1.0, row.abs().max()), t


def test_bfloat16_dot_products_where_the_cpu_has_them():
    """A CPU that lists AVX512-BF16 must take a bfloat16 decode's query . key products on it
    (the fuzz above checks their results): a build that lost the instructions would fall back
    to float32 FMAs and pass every other test. Never for float32 or head sizes off 32."""
    has = "avx512_bf16" in build.cpu_flags()
    for hd in (32, 64, 128):
        assert pa.bf16_dot(torch.bfloat16, hd) == has, hd
    assert not pa.bf16_dot(torch.bfloat16, 80) and not pa.bf16_dot(torch.float32, 64)
    assert not pa.bf16_dot(torch.float16, 64) and not pa.bf16_dot(torch.bfloat16, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_that_climb_past_the_running_maximum(threads, dtype):
    # The AVX-512 kernel keeps a lazy running maximum over 16-key chunks and rescales what it has
    # summed when a score passes it by more than 8: random keys never do. Here each block's
    # scores sit at a level of 0-40 (head 0's exactly, the others' loosely), up and down, so the
    # maximum moves many times, with blocks just below it left to weigh in; 2 threads split the
    # keys into parts merged by their maxima.
    bs, hd, nh, nkv, ctx = 16, 64, 3, 1, 600
    rnd, g = random.Random(7), torch.Generator().manual_seed(7)
    tables, block_table, num_blocks = shuffled_block_tables([ctx + 1], bs, rnd)
    scale = hd ** -0.5
    qkv = torch.randn(1, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=1)
    q0 = q[0, :hd].double()
    kc = torch.zeros(num_blocks, bs, nkv, hd, dtype=dtype)
    vc = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(dtype)
    levels = [rnd.uniform(0, 40) for _ in range(-(-ctx // bs))]
    for s in range(ctx):
        along = (levels[s // bs] + rnd.gauss(0, 1)) / (scale * q0.dot(q0))
        noise = 0.1 * torch.randn(hd, generator=g, dtype=torch.float64)
        kc[tables[0][s // bs], s % bs, 0] = (along * q0 + noise).to(dtype)
    kv = torch.stack([kc, vc])
    out = torch.zeros(1, nh * hd, dtype=dtype)
    step = pa.StepArgs(block_table, torch.tensor([0, 1], dtype=torch.int32),
                       torch.tensor([ctx + 1], dtype=torch.int32),
                       torch.tensor([0], dtype=torch.int32), ctx + 1, bs,
                       torch.tensor([tables[0][ctx // bs] * bs + ctx % bs]), 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pa.run(q, k, v, out, kv, step, scale)
    finally:
        torch.set_num_threads(before)
    want = reference_attention(q, kv[0], kv[1], tables, [0, 1], [ctx + 1], nh, nkv, hd, bs,
                               scale)[0]
    tol = 4e-6 if dtype == torch.float32 else 2 ** -6
    assert (out[0].double() - want).abs().max() <= tol * max(1.0, want.abs().max())
