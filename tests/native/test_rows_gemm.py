"""csrc/rows_gemm.c, the float MoE experts' multi-row GEMM on CPUs without AMX tiles, alone
(`kiln::rows_gemm_native`) against torch's matmul: float32 within 1e-5, bfloat16 within a
rounding step of the output (rtol 2^-7, atol 2e-2, tests/model/test_moe_native.py's tolerance:
only the summation order differs), NaN and infinity where the reference has them, on one
thread and on more threads than blocks. Here this machine's tier (AVX512-BF16 dot products for
bfloat16 where it has them); the lower tiers' in tests/native/_tier_child.py.
"""
import pytest
import torch

from kiln.native import build

pytestmark = pytest.mark.skipif(not build.available(), reason="no C++ compiler")

NONE, AVX512F, BF16_DOT = 0, 1, 2  # csrc/kernels.h's KILN_ROWS_*


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    tol = (1e-5, 1e-5) if got.dtype == torch.float32 else (2 ** -7, 2e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1],
                               equal_nan=True)


def test_the_build_says_how_it_runs_each_dtype():
    has = build.cpu_flags()
    avx512 = {"avx512f", "avx512bw"} <= has
    isa = torch.ops.kiln.fused_experts_rows_isa
    assert isa(0) == (AVX512F if avx512 else NONE)
    assert isa(1) == (BF16_DOT if avx512 and "avx512_bf16" in has else AVX512F if avx512
                      else NONE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_sizes_match_torch(dtype):
    """Rows either side of the 4-row block, weight rows past a 4-row and 32-row block, k not a
    multiple of the 16 / 32 a step (masked tails), k below one step."""
    if torch.ops.kiln.fused_experts_rows_isa(build.DTYPES[dtype]) == NONE:
        return  # no AVX-512: the experts keep the GEMV kernel and aten (test_moe_native.py)
    g = torch.Generator().manual_seed(7)
    for m, n, k in [(1, 1, 1), (1, 5, 7), (3, 37, 33), (4, 64, 32), (5, 96, 64), (7, 40, 95),
                    (9, 33, 17), (17, 130, 257), (33, 70, 48)]:
        x, w = (torch.randn(r, k, generator=g).to(dtype) for r in (m, n))
        _close(torch.ops.kiln.rows_gemm_native(x, w), x @ w.t())
    empty = torch.ops.kiln.rows_gemm_native(torch.zeros(0, 8, dtype=dtype),
                                            torch.zeros(3, 8, dtype=dtype))
    assert empty.shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_infinity_propagate_as_in_torch(dtype):
    """A NaN in x poisons its row, an infinity its row (or NaN where it meets both signs or a
    zero), an infinity in the weight its column; the masked k tail adds none of its own."""
    if torch.ops.kiln.fused_experts_rows_isa(build.DTYPES[dtype]) == NONE:
        return
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 40, generator=g).to(dtype), torch.randn(21, 40, generator=g).to(dtype)
    x[1, 3], x[2, 5], x[5, 39] = float("nan"), float("inf"), float("-inf")
    w[4, 7], w[9, 39] = float("inf"), 0.0
    x[3, 7] = 0.0  # inf * 0: NaN in row 3, column 4
    _close(torch.ops.kiln.rows_gemm_native(x, w), x @ w.t())


@pytest.mark.parametrize("threads", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_thread_and_more_threads_than_blocks(dtype, threads):
    """The kernel alone at 70 rows (17 row blocks and 2 over) and over 33 weight rows (two 32-row
    blocks: 5 threads is more than there are), and the experts' route with 1 thread (experts one
    after another) and 5 (decode-sized experts side by side, each on one thread)."""
    if torch.ops.kiln.fused_experts_rows_isa(build.DTYPES[dtype]) == NONE:
        return
    from kiln import ir

    g = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = torch.randn(70, 45, generator=g).to(dtype), torch.randn(33, 45, generator=g).to(dtype)
        _close(torch.ops.kiln.rows_gemm_native(x, w), x @ w.t())
        # expert e of 0..7 chosen by e + 1 tokens, each token's second one of 8..10 (12 each)
        ids = torch.tensor([[e, 8 + t % 3] for t, e in enumerate(e for e in range(8)
                                                                  for _ in range(e + 1))])
        x = torch.randn(len(ids), 40, generator=g).to(dtype)
        w13, w2 = (torch.randn(*s, generator=g).mul(0.2).to(dtype)
                   for s in ((11, 48, 40), (11, 40, 24)))
        weights = torch.rand(len(ids), 2, generator=g)
        counts = torch.ops.kiln.fused_experts_route_counts()
        got = torch.ops.kiln.fused_experts_native(x, weights, ids, w13, w2)
        ran = [a - b for a, b in zip(torch.ops.kiln.fused_experts_route_counts(), counts)]
        want = ir.fused_moe.reference(x, x.new_empty(len(ids), 11), w13, w2, 2, False, weights,
                                      ids)
        _close(got, want)
        assert sum(ran) == 11 and (ran[3] >= 1 or torch.ops.kiln.fused_experts_tiles())
    finally:
        torch.set_num_threads(before)
