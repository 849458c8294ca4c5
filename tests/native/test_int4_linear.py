"""The native int4_weight_linear (csrc/ops_int4.cpp over int4_linear.c) on the canonical int4 layout
as Kiln holds it: the in-register GEMV (1-8 rows) and the dequantized tiles + GEMM (more rows, and
groups not of 32s) against the float64 product of the exact dequantized weights, for groups of
32 / 64 / 128 and per channel, with and without zero points, float32 / bfloat16 / float16 scales.

Tolerance, float32 x: |out - exact| <= 2^-20 * sum_k |x_k| * 15 |s_k| (the sum's magnitude bound;
float32 rounding, ~1e-6 of it, by summation order); bfloat16 x: the torch reference's own error,
2^-8 (|exact| + sum_k |x_k w_k|) (weights and output rounded to bfloat16).
"""
import pytest
import torch

from kiln.ir import int4
from kiln.native import int4_linear


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    assert int4_linear.kernel_available()  # loads the library (this CPU has AVX-512)


def _weight(n, k, group, zeros, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    packed = int4.pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = (torch.rand(n, k // size, generator=g) * 0.05 + 1e-3).to(scale_dtype)
    z = torch.randint(0, 17, (n, k // size), generator=g, dtype=torch.uint8) if zeros else None
    return packed, scales, z, size


@pytest.mark.parametrize("group", [32, 64, 128, -1, 16])
@pytest.mark.parametrize("zeros", [True, False])
def test_native_int4_linear_is_the_exact_product_up_to_float32_rounding(group, zeros):
    n, k = 40, 256
    scale_dtype = {32: torch.float32, 64: torch.bfloat16}.get(group, torch.float16)
    packed, scales, z, size = _weight(n, k, group, zeros, scale_dtype)
    w = int4.dequantize_int4(packed, scales, z, size).double()  # exact values
    bound_w = 15 * scales.double().repeat_interleave(size, 1)  # >= |u - z| s
    for m in (1, 3, 8, 9, 20, 32, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        bias = torch.randn(n)
        out = torch.ops.kiln.int4_weight_linear_native(x, packed, scales, z, size, bias)
        exact = x.double() @ w.t() + bias.double()
        tol = 2.0 ** -20 * (x.double().abs() @ bound_w.t() + bias.double().abs())
        assert (out.double() - exact).abs().le(tol).all(), (m, (out.double() - exact).abs().max())


@pytest.mark.parametrize("m", [1, 8, 20])
def test_native_int4_linear_in_bfloat16_rounds_as_the_torch_reference(m):
    packed, scales, z, size = _weight(64, 128, 64, True, torch.bfloat16, seed=3)
    x = torch.randn(2, m, 128).to(torch.bfloat16)
    out = torch.ops.kiln.int4_weight_linear_native(x, packed, scales, z, size, None)
    ref = int4._int4_linear_ref(x, packed, scales, z, size)
    assert out.shape == ref.shape == (2, m, 64) and out.dtype == torch.bfloat16
    w = int4.dequantize_int4(packed, scales, z, size).double()
    exact = x.double() @ w.t()
    # the reference's error: its weights and its output rounded to bfloat16
    tol = 2.0 ** -8 * (exact.abs() + x.double().abs() @ w.abs().t())
    assert (ref.double() - exact).abs().le(tol).all()
    assert (out.double() - exact).abs().le(tol).all()


def test_the_gemv_serves_prefill_rows_up_to_where_it_beats_dequantizing():
    """Up to the limit the GEMV runs 8 rows a pass (reading the packed weight each pass): measured
    faster than dequantizing a float32 weight for a GEMM up to 32 rows, a bfloat16 one up to 12
    (docs/measurements.md)."""
    assert int4_linear.gemv_row_limit(torch.float32) == 32
    assert int4_linear.gemv_row_limit(torch.bfloat16) == 12


def test_which_arguments_the_native_kernel_serves():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert int4_linear.serves("cpu", f32, bf16, torch.uint8, None, simd=True)
    assert int4_linear.serves("cpu", bf16, f16, None, bf16, simd=True)
    assert not int4_linear.serves("cpu", f32, bf16, None, None, simd=False)  # no AVX-512 code
    assert not int4_linear.serves("cuda", f32, f32, None, None, simd=True)
    assert not int4_linear.serves("cpu", f16, f32, None, None, simd=True)  # x in float16
    assert not int4_linear.serves("cpu", f32, f32, torch.int32, None, simd=True)
    assert not int4_linear.serves("cpu", f32, f32, None, bf16, simd=True)  # bias dtype


def test_scales_are_kept_in_the_narrowest_exact_16_bit_dtype_and_bits_per_weight():
    bf = torch.rand(4, 8).to(torch.bfloat16).float()
    assert int4_linear.compact_scales(bf).dtype == torch.bfloat16
    half = torch.tensor([[1 + 2 ** -10, 0.5]])  # float16 holds it, bfloat16 does not
    assert int4_linear.compact_scales(half).dtype == torch.float16
    wide = torch.tensor([[1 + 2 ** -20]])
    assert int4_linear.compact_scales(wide).dtype == torch.float32
    packed, scales, z, _ = _weight(16, 1024, 128, True, torch.bfloat16)
    assert int4_linear.bits_per_weight(packed, scales, z) == 4 + 24 / 128
    assert int4_linear.bits_per_weight(packed, scales, None) == 4 + 16 / 128
