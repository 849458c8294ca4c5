"""The SiLU-and-mul + kiln::linear fusion pass: what it matches, what it leaves, and that the
fused op computes what the two did."""
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.model.layers.cpu_gemm  # noqa: F401  (registers kiln::linear, kiln::silu_mul_linear)
from kiln.compilation.passes import FuseSiluMulLinear
from kiln.native import linear_op

needs_op = pytest.mark.skipif(not linear_op.available(), reason="no C++ compiler")


def mlp_down(x, weight):
    d = x.shape[-1] // 2
    return torch.ops.kiln.linear(F.silu(x[..., :d]) * x[..., d:], weight, None)


def halves_swapped(x, weight):
    d = x.shape[-1] // 2
    return torch.ops.kiln.linear(F.silu(x[..., d:]) * x[..., :d], weight, None)


def gate_used_elsewhere(x, weight):
    d = x.shape[-1] // 2
    gate = x[..., :d]
    return torch.ops.kiln.linear(F.silu(gate) * x[..., d:], weight, None), gate * 2


def _graph(fn, *inputs):
    # Inductor's decompositions, as its post-grad graphs have them (silu as g / (1 + exp(-g))).
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return gm


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(dtype=torch.float32, rows=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 128, generator=g).to(dtype), torch.randn(40, 64, generator=g).to(dtype)


@needs_op
@pytest.mark.parametrize("rows", [1, 100])
def test_silu_mul_linear_becomes_one_op_with_the_same_results(rows):
    inputs = _inputs(rows=rows)
    gm = _graph(mlp_down, *inputs)
    assert "aten.exp.default" in _targets(gm)
    FuseSiluMulLinear()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert targets == ["kiln.silu_mul_linear.default"]
    torch.testing.assert_close(gm(*inputs), mlp_down(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn, inputs", [
    (mlp_down, _inputs(torch.bfloat16)),
    (halves_swapped, _inputs()),
    (gate_used_elsewhere, _inputs()),
], ids=["bfloat16", "halves-swapped", "gate-used-elsewhere"])
def test_other_graphs_are_left_alone(fn, inputs):
    gm = _graph(fn, *inputs)
    before = _targets(gm)
    FuseSiluMulLinear()(gm.graph)
    assert _targets(gm) == before


@needs_op
def test_fused_op_on_strided_and_other_dtype_inputs():
    x, weight = _inputs()
    wide = torch.randn(3, 256)[:, ::2]  # columns not contiguous: the torch fallback
    torch.testing.assert_close(torch.ops.kiln.silu_mul_linear(wide, weight),
                               mlp_down(wide, weight), rtol=1e-5, atol=1e-5)
    x64, w64 = x.double(), weight.double()
    torch.testing.assert_close(torch.ops.kiln.silu_mul_linear(x64, w64), mlp_down(x64, w64))
