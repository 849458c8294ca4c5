"""The IR op gguf_linear (kiln/ir/gguf.py): its reference dequantizes Kiln's layout of the blocks
exactly as gguf does; the native kernel against it for every kept ggml type on the edges; the
rule that picks the blocks or the dense copy per row count; selection and lowering.

Tolerance, against the reference (which rounds the values to x's dtype; the blocks kernel reads
them exactly): float32 within 4e-6 of sum |x| |w| per output (a few float32 roundings, x held
in 3 int8 limbs); bfloat16 within 2^-7 of it (the output's rounding and the weight's in the
reference).
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import ir
from kiln.compilation.passes import LowerIrOps
from kiln.ir import gguf_layout
from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear
from kiln.native import gguf_matmul, linear_op

from gguf_blocks import file_blocks as _file_blocks
from gguf_blocks import kernel_blocks as _kernel_blocks
from gguf_blocks import needs_kernel

QTYPES = sorted(gguf_matmul.QTYPES)


@needs_kernel
def test_the_layout_sizes_are_the_kernels():
    for name, qtype in gguf_matmul.QTYPES.items():
        layout = gguf_layout.LAYOUTS[qtype]
        _, file_bytes, file_values, kernel_bytes, group = gguf_matmul._info(qtype)
        assert (layout.file_values, group) == (file_values, gguf_layout.GROUP_ROWS), name
        assert layout.block_bytes * file_values // gguf_layout.QK == kernel_bytes, name
        for shape in ((1, 256), (17, 512), (48, 768)):
            assert gguf_layout.kernel_shape(qtype, *shape) == gguf_matmul.kernel_shape(
                qtype, *shape)
    assert set(gguf_layout.LAYOUTS) == set(gguf_matmul.QTYPES.values())


@needs_kernel
@pytest.mark.parametrize("name", QTYPES)
def test_the_reference_dequantizes_kernel_blocks_as_gguf_does(name):
    qtype = gguf_matmul.QTYPES[name]
    for out_features, in_features in ((1, 256), (17, 512), (33, 768)):
        kernel, values = _kernel_blocks(name, out_features, in_features, seed=out_features)
        assert gguf_layout.fits(kernel, qtype, out_features, in_features)
        got = gguf_layout.dequantize(kernel, qtype, out_features, in_features)
        assert got.dtype == torch.float32 and torch.equal(got, values), (out_features,)


def _within(got, want, x, values, dtype):
    terms = x.double().abs() @ values.double().abs().T
    tol = 4e-6 if dtype == torch.float32 else 2 ** -7
    return ((got.double() - want.double()).abs() <= tol * terms + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_the_reference_on_the_edges(name, dtype):
    """1 row, odd row counts, a tile and more, leading dims, bias or none, with and without a
    dense copy and a plan whose row limit reaches every count (the blocks either way)."""
    qtype = gguf_matmul.QTYPES[name]
    g = torch.Generator().manual_seed(1)
    for out_features in (1, 17, 48):
        kernel, values = _kernel_blocks(name, out_features, 256, seed=out_features)
        for rows in (1, 3, 7, 8, 9, 17, 33):
            x = torch.randn(rows, 256, generator=g).to(dtype)
            bias = torch.randn(out_features, generator=g).to(dtype) if rows % 2 else None
            for dense in ((), (values.to(dtype), None, torch.tensor([0, 64, 3]))):
                args = (x, kernel, qtype, out_features, bias, *dense)
                assert ir.gguf_linear.supported_by("native", *args)
                before = linear_op.path_counts()["blocks"]
                got = ir.gguf_linear.impls["native"].fn(*args)
                assert linear_op.path_counts()["blocks"] == before + 1
                want = ir.gguf_linear.reference(*args)
                assert got.dtype == want.dtype == dtype and got.shape == (rows, out_features)
                assert _within(got, want, x, values, dtype), (out_features, rows)
        x3 = torch.randn(2, 3, 256, generator=g).to(dtype)
        got = ir.gguf_linear.impls["native"].fn(x3, kernel, qtype, out_features)
        assert got.shape == (2, 3, out_features)
        assert _within(got.reshape(6, -1), ir.gguf_linear.reference(
            x3, kernel, qtype, out_features).reshape(6, -1), x3.reshape(6, -1), values, dtype)


PLAN = torch.tensor([2, 16, 3])  # GEMV up to 2 rows, the blocks up to 16


@pytest.mark.parametrize("rows, blocks, dense, packed, plan, path", [
    (1, True, True, True, PLAN, "blocks"),  # the blocks win every count they serve
    (16, True, True, True, PLAN, "blocks"),
    (17, True, True, True, PLAN, "packed"),  # above their limit: the dense copy's kernels
    (17, True, True, False, PLAN, "dense"),
    (1000, True, False, False, PLAN, "blocks"),  # no dense copy: the blocks at any count
    (1, True, True, True, None, "packed"),  # no plan: no blocks beside a dense copy, no GEMV
    (1, False, True, True, PLAN, "gemv"),  # the dense linear: GEMV up to gemv_rows
    (2, False, True, True, PLAN, "gemv"),
    (3, False, True, True, PLAN, "packed"),
    (0, False, True, False, PLAN, "dense"),  # no rows: aten
    (5, False, False, False, PLAN, None),  # nothing serves it
])
def test_the_path_rule(rows, blocks, dense, packed, plan, path):
    assert linear_op.choose_path(rows, blocks, dense, packed, plan) == path


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_takes_the_path_the_rule_names_at_every_row_count(dtype):
    q41 = gguf_matmul.QTYPES["Q4_1"]
    blocks, values = _file_blocks("Q4_1", 40, 256)
    layer = ReplicatedLinear(256, 40, bias=True).to(dtype)
    layer.weight.data.copy_(values)
    assert cpu_gemm.prepack_for_cpu(layer) == 1 and cpu_gemm.attach_gguf_blocks(layer, q41, blocks)
    op, args = cpu_gemm.linear_call(layer, layer.bias)
    assert op is ir.gguf_linear and args[1:3] == (q41, 40)
    held = cpu_gemm.held(layer)
    for rows in (1, 2, 3, held.block_rows, held.block_rows + 1, 2 * held.block_rows + 3):
        want = linear_op.choose_path(rows, True, True, True, layer.cpu_plan)
        before = linear_op.path_counts()
        out = layer(torch.randn(rows, 256).to(dtype))
        after = linear_op.path_counts()
        assert [p for p in after if after[p] != before[p]] == [want], rows
        assert out.shape == (rows, 40) and out.dtype == dtype
    assert linear_op.choose_path(held.block_rows, True, True, True, layer.cpu_plan) == "blocks"


def test_native_refuses_what_the_kernel_cannot_read():
    q41 = gguf_matmul.QTYPES["Q4_1"]
    x, blocks = torch.randn(2, 64), torch.zeros(gguf_layout.kernel_shape(q41, 16, 64),
                                                dtype=torch.uint8)
    ok = (x, blocks, q41, 16)
    assert ir.gguf_linear.supported_by("native", *ok) == gguf_matmul.kernel_available()
    refused = [
        (x.double(), blocks, q41, 16),  # no kernel for float64
        (x, blocks[:, :-1].contiguous(), q41, 16),  # not the layout's shape
        (x, blocks, 11, 16),  # Q3_K: no blocks kept
        (x, blocks, q41, 16, None, torch.randn(16, 64).double()),  # a dense copy of another dtype
        (x, blocks, q41, 16, torch.randn(8)),  # a bias of the wrong length
    ]
    assert not any(ir.gguf_linear.supported_by("native", *a) for a in refused)
    # 15 rows' blocks are 16 rows, the last one padding: the same shape
    assert ir.gguf_linear.supported_by("native", x, blocks, q41, 15) == (
        gguf_matmul.kernel_available())


def test_priority_picks_its_implementation_and_a_torch_choice_keeps_no_blocks():
    default = ir.resolve({}, "cpu", torch.float32)
    assert default.provider("gguf_linear") == ("native" if gguf_matmul.kernel_available()
                                               else "torch")
    forced = ir.resolve({"gguf_linear": ["torch", "native"]}, "cpu", torch.float32)
    assert forced.provider("gguf_linear") == "torch" and forced.provider("linear") == (
        default.provider("linear"))
    blocks, values = _file_blocks("Q8_0", 16, 64)
    try:
        ir.apply(forced)
        assert ir.gguf_linear.bound is ir.gguf_linear.reference
        layer = ReplicatedLinear(64, 16, bias=False)
        layer.weight.data.copy_(values)
        # blocks are held for the native kernel only: the layer keeps its dense linear
        assert not cpu_gemm.attach_gguf_blocks(layer, gguf_matmul.QTYPES["Q8_0"], blocks)
        assert cpu_gemm.linear_call(layer, None)[0] is ir.linear
    finally:
        ir.apply(default)


def _graph_of_one_call(kernel, qtype, out_features, x):
    def fn(x, blocks):
        return torch.ops.kiln.gguf_linear(x, blocks, qtype, out_features)
    gm = make_fx(fn, tracing_mode="fake")(x, kernel)
    return gm


@pytest.mark.parametrize("provider", ["torch", "native"])
def test_lowering_takes_the_chosen_implementation(provider):
    if provider == "native" and not gguf_matmul.kernel_available():
        pytest.skip("the GGUF kernel needs AVX-512")  # covered by the torch case
    q6k = gguf_matmul.QTYPES["Q6_K"]
    kernel, values = _kernel_blocks("Q6_K", 20, 256)
    x = torch.randn(3, 256)
    gm = _graph_of_one_call(kernel, q6k, 20, x)
    selection = ir.resolve({"gguf_linear": [provider]}, "cpu", torch.float32)
    LowerIrOps(selection)(gm.graph)
    gm.recompile()
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "kiln.gguf_linear.default" not in targets
    if provider == "native":
        assert targets == {"kiln.gguf_linear_native.default"}
    else:  # the reference inlined: aten (and prims) ops Inductor can fuse
        assert all(t.startswith(("aten.", "prims.")) for t in targets), targets
    assert _within(gm(x, kernel), ir.gguf_linear.reference(x, kernel, q6k, 20), x, values,
                   torch.float32)


@needs_kernel
def test_a_strided_bias_is_read_as_its_values():
    q80 = gguf_matmul.QTYPES["Q8_0"]
    kernel, values = _kernel_blocks("Q8_0", 16, 64)
    x, bias = torch.randn(3, 64), torch.randn(32)[::2]
    assert ir.gguf_linear.supported_by("native", x, kernel, q80, 16, bias)
    got = ir.gguf_linear.impls["native"].fn(x, kernel, q80, 16, bias)
    want = ir.gguf_linear.reference(x, kernel, q80, 16, bias)
    assert _within(got, want, x, values, torch.float32)
