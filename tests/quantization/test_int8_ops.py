"""The W8A8 int8 ops' native CPU kernels (kiln/native/int8_ops.py) against the plain-torch
references of the IR ops (kiln/ir/quant.py): int8 values, scales and GEMM
results exactly; the fused norm ops equal the unfused native kernels bit for bit.

On a CPU without AVX512-VNNI the kernels are not built for it: the tests then check that
`supported` says so (the reference runs) and that the reference itself is exact.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kiln.ir import quant
from kiln.native import build, layer_ops
from kiln.native import int8_ops as native

ref = SimpleNamespace(**{op.name: op.reference for op in (
    quant.dynamic_int8_quant, quant.int8_scaled_mm, quant.rms_norm_dynamic_int8_quant,
    quant.fused_add_rms_norm_dynamic_int8_quant, quant.silu_and_mul_dynamic_int8_quant)})

DTYPES = [torch.float32, torch.bfloat16]
# (rows, K) of a weight as stored: one token, a few and a batch (the VNNI kernel), many
# (oneDNN's GEMM from native.onednn_min_rows(): 16 in a library built for AMX-INT8, else 64,
# where 19 and 40 rows take the VNNI kernel), K not a multiple of 16 or 64 (masked tails), K == 1
# (torch's own _int_mm is wrong). From native.panels_min_rows() (1024) the panel GEMM over the
# weight packed for the call where K is a multiple of 4 (1031 rows: a last register tile of 5
# rows, or on AMX tiles many blocks of rows; 13 and 96 columns: partial panels), oneDNN's where it
# is not (1029 x 33).
SHAPES = [(1, 576), (5, 100), (19, 192), (40, 576), (70, 33), (130, 192), (3, 1), (300, 576),
          (1031, 576), (1029, 33)]


def _x(rows, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    if rows > 2:
        x[1] = 0  # an all-zero row: scale 0, q 0
    return x


def _native_or_skip_check(x) -> bool:
    if native.isa() is None:
        assert not native.quant_supported(x)
        return False
    return True


def test_reference_quant_round_trips_within_half_a_step():
    x = _x(8, 300, torch.float32)
    q, s = ref.dynamic_int8_quant(x)
    assert q.dtype == torch.int8 and s.shape == (8, 1) and s.dtype == torch.float32
    assert (q[1] == 0).all() and s[1] == 0
    assert ((q.float() * s - x).abs() <= s * 0.5 * (1 + 1e-5)).all()
    assert q.abs().max() == 127


def test_reference_gemm_is_the_integer_product_scaled():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (6, 50), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (7, 50), dtype=torch.int8, generator=g)
    s, ws, b = torch.rand(6, 1), torch.rand(7), torch.randn(7)
    exact = (q.long() @ w.long().t()).float() * s * ws + b
    assert torch.equal(ref.int8_scaled_mm(q, s, w, ws, b, torch.float32), exact)
    assert torch.equal(ref.int8_scaled_mm(q[:, :1], s, w[:, :1], ws, None, torch.float32),
                       (q[:, :1].long() @ w[:, :1].long().t()).float() * s * ws)


def test_cuda_gemm_operands_are_padded_to_what_cublaslt_takes():
    """CUDA's _int_mm takes more than 16 rows and k, n multiples of 8: the reference pads with
    zeros, exact (checked here on CPU, whose _int_mm takes the padded shapes too)."""
    from kiln.ir.quant import _int_mm_padded, cuda_int_mm_padding

    assert cuda_int_mm_padding(1, 64, 96) == (16, 0, 0)
    assert cuda_int_mm_padding(17, 60, 70) == (0, 4, 2)
    assert cuda_int_mm_padding(300, 576, 960) == (0, 0, 0)
    g = torch.Generator().manual_seed(3)
    for m, k, n in ((1, 64, 96), (16, 60, 70), (17, 7, 9), (33, 576, 960)):
        q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        assert torch.equal(_int_mm_padded(q, w), (q.long() @ w.long().t()).int()), (m, k, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", SHAPES)
def test_dynamic_quant_equals_reference(dtype, rows, k):
    x = _x(rows, k, dtype)
    if not _native_or_skip_check(x):
        return
    q, s = native.dynamic_int8_quant(x)
    qr, sr = ref.dynamic_int8_quant(x)
    assert torch.equal(q, qr) and torch.equal(s, sr)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("n", [96, 13])
def test_int8_gemm_equals_reference(dtype, rows, k, n):
    x = _x(rows, k, dtype)
    if not _native_or_skip_check(x):
        return
    q, s = ref.dynamic_int8_quant(x)
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) * 0.02
    for bias in (None, torch.randn(n, generator=g).to(dtype)):
        assert native.gemm_supported(q, s, w, ws, bias, dtype)
        assert torch.equal(native.int8_scaled_mm(q, s, w, ws, bias, dtype),
                           ref.int8_scaled_mm(q, s, w, ws, bias, dtype))


def test_gemm_shapes_reach_both_paths():
    if native.isa() is None:
        return
    assert (native.amx_min_rows() > 0) == ("amx_int8" in native.isa())
    threshold = native.onednn_min_rows()
    assert threshold in (16, 64)  # a library built for AMX-INT8, or not (csrc/ops_int8.cpp)
    assert any(rows < threshold for rows, k in SHAPES if k > 1)
    assert any(rows >= threshold for rows, k in SHAPES if k > 1)
    panels = native.panels_min_rows()
    assert panels == 1024
    assert any(rows >= panels and k % 4 == 0 for rows, k in SHAPES)
    assert any(threshold <= rows < panels for rows, k in SHAPES if k > 1)


def test_amx_int8_runs_where_the_cpu_has_it():
    """A CPU that lists AMX-INT8 (and AVX512-VNNI) must run the packed GEMM's tile kernel: a
    build or an OS that silently lost it would fall back to the VNNI kernel and pass every other
    test (test_int8_panels checks its results at rows either side of the threshold)."""
    if native.isa() is None or not {"amx_tile", "amx_int8"} <= build.cpu_flags():
        assert native.isa() is None or "amx_int8" not in native.isa()
        return
    assert native.isa() == "amx_int8+avx512_vnni" and native.amx_min_rows() == 12


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_with_nan_quantizes_as_the_reference(dtype):
    """NaN stays visible: scale NaN and q 0 for that row, as the reference gives (a vector max
    drops NaN and would have made finite garbage of it); other rows are untouched."""
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, -2.0, 0.5]]).to(dtype)
    if not _native_or_skip_check(x):
        return
    q, s = native.dynamic_int8_quant(x)
    rq, rs = ref.dynamic_int8_quant(x)
    assert s[0].isnan() and rs[0].isnan() and (q[0] == 0).all() and torch.equal(q[0], rq[0])
    assert torch.equal(q[1], rq[1]) and torch.equal(s[1], rs[1])


@pytest.mark.parametrize("row", [[3e-38, -1e-38, 0.0, 2e-38], [1e-40, 0.0, -5e-41, 2e-41],
                                 [float("inf"), 1.0, -2.0, 0.0]], ids=["tiny", "denormal", "inf"])
def test_rows_where_127_over_amax_is_not_finite_quantize_as_the_reference(row):
    """127 / amax overflows for a row below 4e-37, and is 0 for a row holding inf: x * inv then
    holds inf and NaN (0 * inf), which the kernel converted to -128 everywhere, positive
    values and zeros too (helper-24). Both now saturate inf and give 0 for 0 * inf."""
    x = torch.tensor([row, [1.0, -2.0, 0.5, 0.25]])
    rq, rs = ref.dynamic_int8_quant(x)
    if row[0] != float("inf"):
        assert rq[0].tolist() == [127 if v > 0 else -128 if v < 0 else 0 for v in row]
    else:
        assert rq[0].tolist() == [0, 0, 0, 0]
    if not _native_or_skip_check(x):
        return
    q, s = native.dynamic_int8_quant(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)


def test_norm_quant_kernels_take_the_weight_in_xs_dtype_only():
    """The kernel reads the weight in x's dtype, the reference multiplies in the promoted one:
    a float32 weight beside bfloat16 x differed by a step in 31 of 320 values (helper-24)."""
    x = _x(4, 64, torch.bfloat16)
    if not _native_or_skip_check(x):
        return
    weight = torch.ones(64)
    assert not quant.rms_norm_dynamic_int8_quant.supported_by("native", x, weight, 1e-5)
    assert not quant.fused_add_rms_norm_dynamic_int8_quant.supported_by("native", x, x, weight,
                                                                        1e-5)
    assert quant.rms_norm_dynamic_int8_quant.supported_by("native", x,
                                                          weight.to(torch.bfloat16), 1e-5)


def test_gemm_of_rows_that_share_memory():
    """A q or a weight whose rows are one row expanded (stride 0): torch 2.13's _int_mm sums
    those wrong, which the reference and the oneDNN path work around (a copy); the kernels read
    strides as given. 20 rows take the VNNI kernel (or oneDNN's in a library built for AMX), 70
    oneDNN's."""
    g = torch.Generator().manual_seed(5)
    row = torch.randint(-128, 128, (1, 70), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (9, 70), dtype=torch.int8, generator=g)
    for rows in (20, 70):
        x = torch.randint(-128, 128, (rows, 70), dtype=torch.int8, generator=g)
        s, ws = torch.rand(rows, 1, generator=g), torch.rand(9, generator=g)
        for q, wq in ((row.expand(rows, 70), w), (x, row.expand(9, 70))):
            exact = (q.long() @ wq.long().t()).float() * s * ws
            assert torch.equal(ref.int8_scaled_mm(q, s, wq, ws, None, torch.float32), exact)
            if native.isa() is not None:
                assert torch.equal(native.int8_scaled_mm(q, s, wq, ws, None, torch.float32),
                                   exact)


def test_a_nan_bias_stays_nan_in_bfloat16_outputs():
    """A float32 NaN bias with all payload bits set (0x7fffffff, which the sum keeps) is a
    bfloat16 NaN in every column, the 16-wide tail's included: its rounding once carried the
    payload into the sign bit and wrote -0.0 there (csrc/bf16_simd.h's bf16x16 now)."""
    if native.isa() is None:
        return
    g = torch.Generator().manual_seed(5)
    for rows, n in ((3, 13), (40, 48)):  # the VNNI kernel: a tail alone, 32 columns then one
        q = torch.randint(-128, 128, (rows, 64), dtype=torch.int8, generator=g)
        s, w = torch.rand(rows, 1), torch.randint(-128, 128, (n, 64), dtype=torch.int8, generator=g)
        bias = torch.full((n,), 0x7fffffff, dtype=torch.int32).view(torch.float32)
        assert native.gemm_supported(q, s, w, torch.rand(n), bias, torch.bfloat16)
        out = native.int8_scaled_mm(q, s, w, torch.rand(n), bias, torch.bfloat16)
        assert out.isnan().all(), (rows, n)


def test_gemm_over_no_columns_is_the_bias_at_every_row_count():
    """K == 0 (no path may refuse it: the panel GEMM takes K a positive multiple of 4)."""
    for rows in (3, 100, 1030):
        q, s = torch.zeros(rows, 0, dtype=torch.int8), torch.rand(rows, 1)
        w, ws, bias = torch.zeros(5, 0, dtype=torch.int8), torch.rand(5), torch.randn(5)
        want = ref.int8_scaled_mm(q, s, w, ws, bias, torch.float32)
        assert torch.equal(want, bias.expand(rows, 5))
        if native.isa() is not None:
            assert torch.equal(native.int8_scaled_mm(q, s, w, ws, bias, torch.float32), want)


def test_int8_gemm_refuses_mismatched_shapes():
    if native.isa() is None:
        return
    q, s = torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 1)
    with pytest.raises(ValueError, match="do not fit together"):
        native.int8_scaled_mm(q, s, torch.zeros(4, 9, dtype=torch.int8), torch.ones(4), None,
                              torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(1, 576), (5, 100), (70, 64)])
def test_fused_norm_quant_equals_unfused_native_and_reference(dtype, rows, k):
    x = _x(rows, k, dtype)
    if not _native_or_skip_check(x):
        return
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(k, generator=g).to(dtype)
    residual = torch.randn(rows, k, generator=g).to(dtype)
    q, s = native.rms_norm_dynamic_int8_quant(x, weight, 1e-5)
    uq, us = native.dynamic_int8_quant(layer_ops.rms_norm(x, weight, 1e-5))
    assert torch.equal(q, uq) and torch.equal(s, us)
    q, s, total = native.fused_add_rms_norm_dynamic_int8_quant(x, residual, weight, 1e-5)
    normed, utotal = layer_ops.rms_norm(x, weight, 1e-5, residual)
    uq, us = native.dynamic_int8_quant(normed)
    assert torch.equal(q, uq) and torch.equal(s, us) and torch.equal(total, utotal)
    # against the reference: the native RMSNorm sums squares in another order (float32 may
    # round its last bit differently), so q may move by one step at a rounding boundary
    rq, rs, rtotal = ref.fused_add_rms_norm_dynamic_int8_quant(x, residual, weight, 1e-5)
    assert torch.equal(total, rtotal)
    assert (q.int() - rq.int()).abs().max() <= 1
    assert torch.allclose(s, rs, rtol=2 ** -7, atol=0)


def _same(a, b):
    """Equal, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [100, 576])
def test_fused_norm_quant_equals_unfused_native_on_rows_whose_scale_is_not_finite(dtype, k):
    """The bfloat16 norm + quant takes each row in one pass and hands a row whose absmax is NaN
    or inf, or whose 127 / absmax overflows, to the quant kernel's own handling: every row as
    the norm kernel then the quant kernel give it, beside ordinary and all-zero rows."""
    x = _x(70, k, dtype)
    if not _native_or_skip_check(x):
        return
    x[3, 7] = float("nan")
    x[4, 0] = float("inf")  # squares inf: rsqrt 0, the normed inf * 0 NaN
    x[5] = 1e30  # squares overflow: rsqrt 0, the normed row 0
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(70, k, generator=g).to(dtype)
    # 5e-38: every row's absmax below 4e-37, where 127 / absmax overflows
    for weight in (torch.randn(k, generator=g).to(dtype), torch.full((k,), 5e-38, dtype=dtype)):
        q, s = native.rms_norm_dynamic_int8_quant(x, weight, 1e-5)
        uq, us = native.dynamic_int8_quant(layer_ops.rms_norm(x, weight, 1e-5))
        assert torch.equal(q, uq) and _same(s, us)
        assert s[3].isnan() and s[4].isnan() and s[5] == 0 and s[1] == 0
        q, s, total = native.fused_add_rms_norm_dynamic_int8_quant(x, residual, weight, 1e-5)
        normed, utotal = layer_ops.rms_norm(x, weight, 1e-5, residual)
        uq, us = native.dynamic_int8_quant(normed)
        assert torch.equal(q, uq) and _same(s, us) and _same(total, utotal)
        assert s[3].isnan() and s[5] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [100, 1536])
def test_fused_silu_quant_equals_unfused_native_on_rows_whose_scale_is_not_finite(dtype, d):
    """As the norm's: the bfloat16 rows in one pass, a row whose absmax is NaN or inf or whose
    127 / absmax overflows by the quant kernel's own handling, as the unfused kernels give."""
    x = _x(70, 2 * d, dtype)
    if not _native_or_skip_check(x):
        return
    x[3, 7] = float("nan")
    x[4, d + 1] = float("inf")  # an up value: that product inf
    x[5] = 1e-19  # silu(1e-19) * 1e-19 ~ 5e-39: 127 / absmax overflows
    q, s = native.silu_and_mul_dynamic_int8_quant(x)
    uq, us = native.dynamic_int8_quant(layer_ops.silu_and_mul(x))
    assert torch.equal(q, uq) and _same(s, us)
    assert s[3].isnan() and s[4].isinf() and s[1] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 768), (5, 50), (70, 64), (130, 100)])
def test_fused_silu_quant_equals_unfused_native(dtype, rows, d):
    """Bit for bit: the SiLU-and-mul kernel takes every value through the same path whatever the
    call's rows and alignment (the fused op calls it on 16-row chunks of its own scratch). The
    reference's own exp differs in the last bit, which may move q by one step."""
    x = _x(rows, 2 * d, dtype)
    if not _native_or_skip_check(x):
        return
    q, s = native.silu_and_mul_dynamic_int8_quant(x)
    uq, us = native.dynamic_int8_quant(layer_ops.silu_and_mul(x))
    assert torch.equal(q, uq) and torch.equal(s, us)
    rq, rs = ref.silu_and_mul_dynamic_int8_quant(x)
    assert (q.int() - rq.int()).abs().max() <= 1
    assert torch.allclose(s, rs, rtol=2 ** -7, atol=0)


def test_ir_ops_native_where_supported_else_the_reference():
    x = _x(4, 64, torch.bfloat16)
    has = native.isa() is not None
    assert quant.dynamic_int8_quant.supported_by("native", x) == has
    # no kernel dtype: the reference
    assert not quant.dynamic_int8_quant.supported_by("native", x.to(torch.float16))
    args = quant.int8_scaled_mm.example_args(torch.bfloat16, "cpu")
    assert quant.int8_scaled_mm.supported_by("native", *args) == has
    assert not quant.int8_scaled_mm.supported_by("native", args[0].float(), *args[1:])


def test_thresholds_answer_before_anything_loads_the_kernels():
    """The row thresholds load the library themselves (a fresh process asks them first)."""
    code = ("from kiln.native import int8_ops as n; "
            "print(n.amx_min_rows(), n.onednn_min_rows(), n.panels_min_rows(), "
            "n.mm_silu_quant_min_rows())")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert got == [str(native.amx_min_rows()), str(native.onednn_min_rows()),
                   str(native.panels_min_rows()), str(native.mm_silu_quant_min_rows())]


_ONEDNN_CHILD = """
import torch
from kiln.ir import quant
g = torch.Generator().manual_seed(0)
q = torch.randint(-128, 128, (64, 576), generator=g, dtype=torch.int8)
w = torch.randint(-128, 128, (1536, 576), generator=g, dtype=torch.int8)
ones = torch.ones(64, 1), torch.ones(1536)
got = quant.int8_scaled_mm.reference(q, ones[0], w, ones[1], None, torch.float32)
exact = (q.to(torch.int64) @ w.to(torch.int64).t()).to(torch.float32)
assert torch.equal(got, exact)
"""


def test_without_dot_products_the_reference_still_sums_exactly():
    """A CPU without VNNI (Zen 2/3, Haswell, Skylake-X), shown by capping oneDNN there: its
    int8 GEMM saturates pairs of products in int16, and the reference's answers were 7-13%
    off (helper-24). The reference now sums in float64 there; the native GEMM over weights as
    stored, whose larger row counts are oneDNN's, steps aside."""
    child = _ONEDNN_CHILD + """
from kiln.native import int8_ops
assert not int8_ops.cpu_int_mm_exact()
assert not int8_ops.gemm_supported(q, ones[0], w, ones[1], None, torch.float32)
"""
    for cap in ("AVX2", "AVX512_CORE"):
        subprocess.run([sys.executable, "-c", child], env={**os.environ, "ONEDNN_MAX_CPU_ISA": cap},
                       check=True)


@pytest.mark.parametrize("flags, cap, exact", [
    ({"avx2", "avx512_vnni"}, None, True), ({"avx2", "avx_vnni"}, None, True),
    ({"amx_int8", "avx512_vnni"}, "AVX512_CORE_AMX", True), ({"avx2", "avx512f"}, None, False),
    ({"avx2", "avx512_vnni"}, "avx2", False), ({"avx2", "avx512_vnni"}, "AVX512_CORE", False),
    ({"avx2", "avx_vnni"}, "AVX2_VNNI", True), ({"avx2", "avx512_vnni"}, "AVX2_VNNI", False),
    ({"avx2", "avx512_vnni", "avx_vnni"}, "avx2_vnni_2", True), (set(), None, False)])
def test_onednn_int8_is_exact_only_with_dot_products(flags, cap, exact):
    assert native.onednn_int8_exact(flags, cap) is exact


def test_without_avx512_the_gemm_is_onednns_vnni():
    """A CPU with AVX-VNNI and no AVX-512 (client Intel) gets no native int8 kernels; the
    reference's GEMM is torch._int_mm, which oneDNN runs there with AVX-VNNI dot products.
    Shown by capping oneDNN at AVX2_VNNI in a child process (oneDNN reads the cap once). A CPU
    with AVX512-VNNI and no AVX-VNNI (Zen 4) has plain AVX2 under that cap: the reference sums
    in float64 there, exactly all the same."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ONEDNN_VERBOSE": "1"}
    has_avx_vnni = "avx_vnni" in build.cpu_flags()
    child = _ONEDNN_CHILD + f"""
from kiln.native import int8_ops
assert int8_ops.cpu_int_mm_exact() is {has_avx_vnni}
"""
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                         text=True, check=True).stdout
    s8_runs = any(",exec," in line and "s8" in line for line in out.splitlines())
    if has_avx_vnni:
        isa = next(line for line in out.splitlines() if ",isa:" in line)
        assert "AVX2 with Intel DL Boost" in isa, isa
        assert s8_runs
    else:
        assert not s8_runs, out  # oneDNN's int8 GEMM would saturate: the float64 sum ran
