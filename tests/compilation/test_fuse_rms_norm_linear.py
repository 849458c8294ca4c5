"""The add + RMSNorm + kiln::linear fusion pass: what it matches, what it leaves, and that the
fused op computes what the three did."""
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.model.layers.cpu_gemm  # noqa: F401  (registers kiln::linear, kiln::add_rms_norm_linear)
from kiln.compilation.backend import fusion_passes_apply
from kiln.compilation.passes import FuseAddRmsNormLinear
from kiln.config import CompilationConfig
from kiln.native import linear_op

needs_op = pytest.mark.skipif(not linear_op.available(), reason="no C++ compiler")
EPS = 1e-5


def rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def block(a, b, norm_w, weight):
    """A decoder's residual add, RMSNorm and the next linear; the sum is used again later."""
    x = a + b
    y = torch.ops.kiln.linear(rms_norm(x, norm_w), weight, None)
    return y, x * 2.0


def norm_without_add(a, norm_w, weight):
    return torch.ops.kiln.linear(rms_norm(a, norm_w), weight, None)


def sum_used_before_linear(a, b, norm_w, weight):
    x = a + b
    early = x * 3.0
    return torch.ops.kiln.linear(rms_norm(x, norm_w), weight, None), early


def _graph(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return gm


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(dtype=torch.float32, rows=3, h=64, out=48):
    g = torch.Generator().manual_seed(0)
    shapes = [(rows, h), (rows, h), (h,), (out, h)]  # a, b, norm weight, linear weight
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


@needs_op
@pytest.mark.parametrize("rows", [1, 3, 200])  # 200: the kernel's rows in parallel
def test_add_norm_linear_becomes_one_op_with_the_same_results(rows):
    inputs = _inputs(rows=rows)
    gm = _graph(block, *inputs)
    FuseAddRmsNormLinear()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert "kiln.add_rms_norm_linear.default" in targets
    assert not any("rsqrt" in t or "kiln.linear" in t for t in targets)
    got, want = gm(*inputs), block(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the sum is exact


@pytest.mark.parametrize("fn, inputs", [
    (block, _inputs(torch.bfloat16)),  # the bfloat16 form casts: not this pattern
    (norm_without_add, _inputs()[::2] + _inputs()[3:]),
    (sum_used_before_linear, _inputs()),  # the fused op would come too late for that user
], ids=["bfloat16", "no-add", "sum-used-before"])
def test_other_graphs_are_left_alone(fn, inputs):
    gm = _graph(fn, *inputs)
    before = _targets(gm)
    FuseAddRmsNormLinear()(gm.graph)
    assert _targets(gm) == before


@needs_op
def test_fused_op_falls_back_to_torch_for_other_dtypes_and_shapes():
    a, b, w, weight = _inputs(torch.float64)
    out, total = torch.ops.kiln.add_rms_norm_linear(a, b, w, EPS, weight)
    torch.testing.assert_close(out, torch.nn.functional.linear(rms_norm(a + b, w), weight))
    assert torch.equal(total, a + b)
    a, b, w, weight = _inputs()
    bias = torch.randn(weight.shape[0])
    out, _ = torch.ops.kiln.add_rms_norm_linear(a.t().contiguous().t(), b, w, EPS, weight, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(rms_norm(a + b, w), weight, bias),
                               rtol=1e-5, atol=1e-5)


def test_fusion_passes_apply_on_cpu_unless_switched_off():
    def config(device, pass_config):
        return SimpleNamespace(compilation_config=CompilationConfig(pass_config=pass_config),
                               device_config=SimpleNamespace(device=device))

    assert fusion_passes_apply(config("cpu", {})) == linear_op.available()
    assert not fusion_passes_apply(config("cpu", {"enable_fusion": False}))
    assert not fusion_passes_apply(config("cuda", {}))
