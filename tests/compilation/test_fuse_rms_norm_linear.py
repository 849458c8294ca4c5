"""The fused_add_rms_norm -> linear fusion pass on IR graphs: what it matches, what it leaves,
and that the fused op computes what the two did."""
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import ir
from kiln.compilation.backend import fusion_passes
from kiln.compilation.passes import FuseAddRmsNormLinear, FuseSiluMulLinear
from kiln.config import CompilationConfig
from kiln.native import gguf_matmul, linear_op

EPS = 1e-5
kiln = torch.ops.kiln


def block(x, res, norm_w, weight):
    """A decoder's residual add + RMSNorm and the next linear; the sum is used again later."""
    normed, total = kiln.fused_add_rms_norm(x, res, norm_w, EPS)
    return kiln.linear(normed, weight, None), total * 2.0


def normed_used_elsewhere(x, res, norm_w, weight):
    normed, total = kiln.fused_add_rms_norm(x, res, norm_w, EPS)
    return kiln.linear(normed, weight, None), normed + 1.0, total


def norm_without_add(x, res, norm_w, weight):
    return kiln.linear(kiln.rms_norm(x, norm_w, EPS), weight, None)


def _graph(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return gm


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(dtype=torch.float32, rows=3, h=64, out=48, weight_dtype=None):
    g = torch.Generator().manual_seed(0)
    shapes = [(rows, h), (rows, h), (h,), (out, h)]  # x, residual, norm weight, linear weight
    ts = [torch.randn(shape, generator=g).to(dtype) for shape in shapes]
    if weight_dtype is not None:
        ts[3] = ts[3].to(weight_dtype)
    return ts


def test_the_fused_op_kernel_is_built():
    assert linear_op.available(), "csrc/fused_linear_op.cpp did not build (see the warning)"


@pytest.mark.parametrize("rows", [1, 3, 200])  # 200: the kernel's rows in parallel
def test_add_norm_linear_becomes_one_op_with_the_same_results(rows):
    inputs = _inputs(rows=rows)
    gm = _graph(block, *inputs)
    unfused = block(*inputs)
    fuse = FuseAddRmsNormLinear()
    fuse(gm.graph)
    gm.recompile()
    assert fuse.matched == 1
    targets = _targets(gm)
    assert "kiln.add_rms_norm_linear.default" in targets
    assert "kiln.linear.default" not in targets and "kiln.fused_add_rms_norm.default" not in targets
    got = gm(*inputs)
    torch.testing.assert_close(got[0], unfused[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], unfused[1], rtol=0, atol=0)  # the sum is exact


@pytest.mark.parametrize("fn, inputs", [
    (block, _inputs(torch.bfloat16)),  # the kernel's exact path is float32 only
    (block, _inputs(weight_dtype=torch.float64)),  # the dtypes differ
    (normed_used_elsewhere, _inputs()),  # the intermediate has another user
    (norm_without_add, _inputs()),  # another IR op
], ids=["bfloat16", "dtypes-differ", "normed-used-elsewhere", "no-add"])
def test_other_graphs_are_left_alone(fn, inputs):
    gm = _graph(fn, *inputs)
    before = _targets(gm)
    fuse = FuseAddRmsNormLinear()
    fuse(gm.graph)
    assert _targets(gm) == before and fuse.matched == 0


def test_fused_op_falls_back_to_torch_for_other_dtypes_and_shapes():
    a, b, w, weight = _inputs(torch.float64)
    out, total = kiln.add_rms_norm_linear(a, b, w, EPS, weight)
    ref_normed, ref_total = ir.fused_add_rms_norm.reference(a, b, w, EPS)
    torch.testing.assert_close(out, torch.nn.functional.linear(ref_normed, weight))
    assert torch.equal(total, ref_total)
    a, b, w, weight = _inputs()
    bias = torch.randn(weight.shape[0])
    out, _ = kiln.add_rms_norm_linear(a.t().contiguous().t(), b, w, EPS, weight, bias)
    ref_normed, _ = ir.fused_add_rms_norm.reference(a, b, w, EPS)
    torch.testing.assert_close(out, torch.nn.functional.linear(ref_normed, weight, bias),
                               rtol=1e-5, atol=1e-5)


def _config(device, pass_config, chosen):
    selection = ir.Selection(tuple(sorted({**{n: "native" for n in ir.REGISTRY},
                                           **chosen}.items())))
    return SimpleNamespace(compilation_config=CompilationConfig(pass_config=pass_config),
                           device_config=SimpleNamespace(device=device), ir_selection=selection)


def test_fusion_passes_follow_the_chosen_implementations():
    names = [type(p) for p in fusion_passes(_config("cpu", {}, {}))]
    assert names == [FuseAddRmsNormLinear, FuseSiluMulLinear]
    assert not fusion_passes(_config("cpu", {"enable_fusion": False}, {}))
    assert not fusion_passes(_config("cuda", {}, {}))
    assert [p.linear_ops for p in fusion_passes(_config("cpu", {}, {}))] == [
        ("linear", "gguf_linear")] * 2
    # the fused op of each linear IR op stands for its native kernel
    assert [p.linear_ops for p in fusion_passes(_config("cpu", {}, {"linear": "torch"}))] == [
        ("gguf_linear",)] * 2
    assert not fusion_passes(_config("cpu", {}, {"linear": "torch", "gguf_linear": "torch"}))
    assert [type(p) for p in fusion_passes(_config("cpu", {}, {"silu_and_mul": "torch"}))] == [
        FuseAddRmsNormLinear]


def gguf_block(x, res, norm_w, blocks, weight):
    """The same over a weight held as GGUF blocks (Q8_0), with its dense copy."""
    normed, total = kiln.fused_add_rms_norm(x, res, norm_w, EPS)
    return kiln.gguf_linear(normed, blocks, 8, 48, None, weight), total * 2.0


@pytest.mark.skipif(not gguf_matmul.kernel_available(), reason="the GGUF kernel needs AVX-512")
def test_add_norm_gguf_linear_becomes_one_op_with_the_same_results():
    import gguf

    x, res, norm_w, weight = _inputs(rows=3)
    q8 = gguf.GGMLQuantizationType.Q8_0
    file_blocks = gguf.quants.quantize(weight.numpy(), q8)
    weight = torch.from_numpy(gguf.quants.dequantize(file_blocks, q8).reshape(48, 64).copy())
    blocks = gguf_matmul.kernel_blocks(8, torch.from_numpy(file_blocks))
    inputs = (x, res, norm_w, blocks, weight)
    gm = _graph(gguf_block, *inputs)
    unfused = gguf_block(*inputs)
    only_dense = FuseAddRmsNormLinear(("linear",))  # fuses into the dense linear alone
    only_dense(gm.graph)
    assert only_dense.matched == 0
    fuse = FuseAddRmsNormLinear()
    fuse(gm.graph)
    gm.recompile()
    assert fuse.matched == 1
    targets = _targets(gm)
    assert "kiln.add_rms_norm_gguf_linear.default" in targets
    assert "kiln.gguf_linear.default" not in targets
    got = gm(*inputs)
    torch.testing.assert_close(got[0], unfused[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], unfused[1])
    # its meaning off the CPU kernel: the composition of the references
    from kiln.ir import fused

    ref = fused._add_rms_norm_gguf_linear(x, res, norm_w, EPS, blocks, 8, 48, None, weight)
    torch.testing.assert_close(ref[0], unfused[0], rtol=1e-5, atol=1e-5)
