"""The silu_and_mul -> linear fusion pass on IR graphs: what it matches, what it leaves, and that
the fused op computes what the two did."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import ir
from kiln.compilation.passes import FuseSiluMulLinear
from kiln.native import gguf_matmul

kiln = torch.ops.kiln


def mlp_down(x, weight):
    return kiln.linear(kiln.silu_and_mul(x), weight, None)


def act_used_elsewhere(x, weight):
    act = kiln.silu_and_mul(x)
    return kiln.linear(act, weight, None), act * 2


def _graph(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return gm


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(dtype=torch.float32, rows=3, weight_dtype=None):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 128, generator=g).to(dtype), torch.randn(40, 64, generator=g)
    return x, w.to(weight_dtype or dtype)


@pytest.mark.parametrize("rows", [1, 100])
def test_silu_mul_linear_becomes_one_op_with_the_same_results(rows):
    inputs = _inputs(rows=rows)
    gm = _graph(mlp_down, *inputs)
    unfused = mlp_down(*inputs)
    fuse = FuseSiluMulLinear()
    fuse(gm.graph)
    gm.recompile()
    assert _targets(gm) == ["kiln.silu_mul_linear.default"] and fuse.matched == 1
    torch.testing.assert_close(gm(*inputs), unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn, inputs", [
    (mlp_down, _inputs(torch.bfloat16)),
    (mlp_down, _inputs(weight_dtype=torch.float64)),
    (act_used_elsewhere, _inputs()),
], ids=["bfloat16", "dtypes-differ", "act-used-elsewhere"])
def test_other_graphs_are_left_alone(fn, inputs):
    gm = _graph(fn, *inputs)
    before = _targets(gm)
    fuse = FuseSiluMulLinear()
    fuse(gm.graph)
    assert _targets(gm) == before and fuse.matched == 0


def test_fused_op_on_strided_and_other_dtype_inputs():
    x, weight = _inputs()
    wide = torch.randn(3, 256)[:, ::2]  # columns not contiguous: the torch fallback
    want = torch.nn.functional.linear(ir.silu_and_mul.reference(wide), weight)
    torch.testing.assert_close(kiln.silu_mul_linear(wide, weight), want, rtol=1e-5, atol=1e-5)
    x64, w64 = x.double(), weight.double()
    torch.testing.assert_close(kiln.silu_mul_linear(x64, w64),
                               torch.nn.functional.linear(ir.silu_and_mul.reference(x64), w64))


def gguf_mlp_down(x, blocks):
    """The down projection over a weight held as GGUF blocks alone (Q4_0)."""
    return kiln.gguf_linear(kiln.silu_and_mul(x), blocks, 2, 40)


@pytest.mark.skipif(not gguf_matmul.kernel_available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("rows", [1, 100])
def test_silu_mul_gguf_linear_becomes_one_op_with_the_same_results(rows):
    import gguf

    x, w = _inputs(rows=rows)
    file_blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    blocks = gguf_matmul.kernel_blocks(2, torch.from_numpy(file_blocks))
    gm = _graph(gguf_mlp_down, x, blocks)
    unfused = gguf_mlp_down(x, blocks)
    fuse = FuseSiluMulLinear()
    fuse(gm.graph)
    gm.recompile()
    assert _targets(gm) == ["kiln.silu_mul_gguf_linear.default"] and fuse.matched == 1
    torch.testing.assert_close(gm(x, blocks), unfused, rtol=1e-5, atol=1e-5)
