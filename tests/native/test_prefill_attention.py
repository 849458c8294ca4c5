"""The prefill-attention C kernel (kiln/native/prefill_attention.py) against a float64 softmax over
each request's gathered context: causal with cached context, GQA 1/3/4, head sizes 36-256, one-token
and odd query lengths, cache block sizes 1-32, several requests in one call, both code paths."""
import random

import pytest
import torch
from paged_reference import reference_attention, shuffled_block_tables

from kiln.native import build
from kiln.native import paged_attention as pa
from kiln.native import prefill_attention as pf

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")

CASES = [  # block size, head size, heads, kv heads, query lengths, cached context lengths
    (16, 64, 9, 3, [37, 130], [0, 45]), (16, 80, 4, 1, [1, 17, 64], [20, 0, 33]),
    (32, 128, 2, 2, [33], [100]), (3, 64, 8, 2, [50, 16], [7, 0]), (1, 72, 6, 6, [20], [5]),
    (16, 36, 4, 2, [19], [3]), (16, 256, 4, 2, [40], [60]), (16, 64, 3, 1, [300], [420]),
    # queries of over 32 tokens over 256 keys or more: the bfloat16 tiles gather their keys once
    (16, 64, 6, 2, [40, 200, 33], [300, 60, 250]), (8, 64, 9, 3, [300, 45], [0, 400]),
]


def _step(case, dtype, cases=CASES, grow=0.0):
    """A cache holding every request's context and query K/V (NaN in the slots no request owns;
    the key of position s times 1 + grow * s), q as strided rows of a fused qkv, the step's
    metadata with the last request left out when there are several (its rows must stay
    untouched)."""
    bs, hd, nh, nkv, q_lens, ctx = cases[case]
    rnd, g = random.Random(case), torch.Generator().manual_seed(case)
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    tables, block_table, num_blocks = shuffled_block_tables(seq_lens, bs, rnd)
    kv = torch.full((2, num_blocks, bs, nkv, hd), float("nan"), dtype=dtype)
    for r, table in enumerate(tables):
        for s in range(seq_lens[r]):
            kv[:, table[s // bs], s % bs] = torch.randn(2, nkv, hd, generator=g).to(dtype)
            kv[0, table[s // bs], s % bs] *= 1 + grow * s
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], nh * hd + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    reqs = list(range(len(q_lens) - 1 if len(q_lens) > 2 else len(q_lens)))
    step = pa.StepArgs(block_table, torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(seq_lens, dtype=torch.int32),
                       torch.tensor(reqs, dtype=torch.int32), max(seq_lens), bs,
                       torch.zeros(0, dtype=torch.int64), 0)
    want = reference_attention(q, kv[0], kv[1], tables, starts, seq_lens, nh, nkv, hd, bs,
                               hd ** -0.5, reqs)
    return q, kv, step, want


@pytest.mark.parametrize("path", list(pf.PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_float64_softmax(case, dtype, path):
    q, kv, step, want = _step(case, dtype)
    hd = kv.shape[-1]
    out = torch.full((q.shape[0], q.shape[1]), 7.0, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(1 + case % 2)
    try:
        pf.run(q, out, kv, step, hd ** -0.5, path=path)
    finally:
        torch.set_num_threads(before)
    # measured worst (max error over the row's largest value, both paths): float32 1e-6
    # (summation order); bfloat16 4e-3, the output's own rounding (2^-9) plus the probabilities'
    # (rounded to bfloat16 before P.V, as SDPA does)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for t in range(q.shape[0]):
        if t in want:
            row = want[t]
            assert (out[t].double() - row).abs().max() <= tol * max(1.0, row.abs().max()), t
        else:  # a request not selected: its rows untouched
            assert (out[t] == 7.0).all(), t


def test_bfloat16_tiles_mean_error_is_the_roundings():
    """The bfloat16 tiles' mean error against float64 over CASES is what the bfloat16 roundings
    (probabilities, outputs) give the portable path: a coarser 2^x for the probabilities shows
    here, not in the per-row maximum, which the outputs' rounding fills (measured, of the mean
    |output|: portable 0.0019, the tiles 0.0020 with a degree-3 or degree-6 2^x and 0.0029 with a
    degree-2 one, whose worst row still passed test_matches_float64_softmax)."""
    err = {"avx512": 0.0, "portable": 0.0}
    for case in range(len(CASES)):
        q, kv, step, want = _step(case, torch.bfloat16)
        for path in err:
            out = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bfloat16)
            pf.run(q, out, kv, step, kv.shape[-1] ** -0.5, path=path)
            err[path] += sum((out[t].double() - row).abs().sum().item()
                             for t, row in want.items())
    assert err["avx512"] <= 1.1 * err["portable"], err


# one request whose units see up to 8 key blocks (gathered: the bfloat16 tiles take two blocks'
# P.V in one pass), and one of 3 over 2 blocks
GROWING = [(16, 64, 9, 3, [64, 40], [448, 100])]


@pytest.mark.parametrize("path", ["avx512", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_running_maximum_moves_in_later_key_blocks(dtype, path):
    """Keys growing with their position (by 1/16 a key: a key block's largest score passes the
    running maximum's by more than the tiles' lazy margin of 2^12), so the outputs and sums are
    rescaled between key blocks, held blocks' too; random keys almost never move it."""
    q, kv, step, want = _step(0, dtype, GROWING, grow=1 / 16)
    out = torch.full((q.shape[0], q.shape[1]), 7.0, dtype=dtype)
    pf.run(q, out, kv, step, kv.shape[-1] ** -0.5, path=path)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for t, row in want.items():
        assert (out[t].double() - row).abs().max() <= tol * max(1.0, row.abs().max()), t


def test_simd_tiles_cover_the_common_head_sizes():
    # every head size a multiple of 8 or none (a CPU without AVX512F; bfloat16 needs AVX512-BF16
    # too): the CPU backend sends long queries to SDPA where they do not serve
    for dtype in (torch.float32, torch.bfloat16):
        assert len({pf.simd(dtype, hd) for hd in (8, 64, 80, 128, 256)}) == 1
        assert not pf.simd(dtype, 36)


def test_bad_lengths_are_an_error():
    q, kv, step, _ = _step(0, torch.float32)
    step.seq_lens = step.seq_lens.clone()
    step.seq_lens[0] = 3  # shorter than its query
    with pytest.raises(RuntimeError, match="below its query length"):
        pf.run(q, torch.empty(q.shape[0], q.shape[1]), kv, step, 1.0)


def test_amx_tiles_serve_bfloat16_where_the_cpu_has_them():
    """A CPU that lists AMX-BF16 must run the AMX tiles (the `best` path of the test above),
    for head sizes that are a multiple of 32: a build or an OS that lost them would fall back to
    the AVX512-BF16 tiles and pass every other test. Never for float32."""
    has = {"amx_tile", "amx_bf16", "avx512_bf16"} <= build.cpu_flags()
    for hd in (64, 128, 256):
        assert pf.amx(torch.bfloat16, hd) == has, hd
    assert not pf.amx(torch.bfloat16, 80) and not pf.amx(torch.float32, 64)
