"""The W8A8 passes on IR graphs: fuse_norm_quant ((add +) RMSNorm -> dynamic quant), fuse_act_quant
(SiLU-and-mul -> dynamic quant), fuse_mm_act_quant (the packed int8 GEMM -> the fused SiLU-and-mul
+ quant), eliminate_noops; what each matches, what it leaves (a normed
value with a second user), and that the rewritten graph computes what the original did.
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.compilation.passes import EliminateNoops, FuseActQuant, FuseMmActQuant, FuseNormQuant
from kiln.ir.int8_panels import pack_int8_panels

EPS = 1e-5
kiln = torch.ops.kiln


def norm_quant(x, res, w):
    q, s = kiln.dynamic_int8_quant(kiln.rms_norm(x, w, EPS))
    return q, s


def add_norm_quant(x, res, w):
    normed, total = kiln.fused_add_rms_norm(x, res, w, EPS)
    q, s = kiln.dynamic_int8_quant(normed)
    return q, s, total * 2.0


def normed_used_twice(x, res, w):
    normed, total = kiln.fused_add_rms_norm(x, res, w, EPS)
    q, s = kiln.dynamic_int8_quant(normed)
    return q, s, normed + 1.0, total


def act_quant(x, res, w):
    gate_up = torch.cat([x, res], dim=-1)
    return kiln.dynamic_int8_quant(kiln.silu_and_mul(gate_up))


def act_used_twice(x, res, w):
    a = kiln.silu_and_mul(torch.cat([x, res], dim=-1))
    q, s = kiln.dynamic_int8_quant(a)
    return q, s, a.sum()


def mm_act_quant(q, scale, w_panels, w_scale):
    gate_up = kiln.int8_scaled_mm_panels(q, scale, w_panels, w_scale, None, torch.bfloat16)
    return kiln.dynamic_int8_quant(kiln.silu_and_mul(gate_up))


def mm_used_twice(q, scale, w_panels, w_scale):
    gate_up = kiln.int8_scaled_mm_panels(q, scale, w_panels, w_scale, None, torch.bfloat16)
    q2, s2 = kiln.dynamic_int8_quant(kiln.silu_and_mul(gate_up))
    return q2, s2, gate_up.sum()


def _mm_inputs(rows=5, k=64, n=128):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return [q, torch.rand(rows, 1, generator=g) * 0.05, pack_int8_panels(w),
            torch.rand(n, generator=g) * 0.05]


def _inputs(dtype=torch.bfloat16, rows=5, h=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((rows, h), (rows, h), (h,))]


def _graph(fn, inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    return gm


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("fn, pass_cls, fused", [
    (norm_quant, FuseNormQuant, "kiln.rms_norm_dynamic_int8_quant.default"),
    (add_norm_quant, FuseNormQuant, "kiln.fused_add_rms_norm_dynamic_int8_quant.default"),
    (act_quant, FuseActQuant, "kiln.silu_and_mul_dynamic_int8_quant.default"),
], ids=["rms_norm", "fused_add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusion_matches_once_and_keeps_every_bit(fn, pass_cls, fused, dtype):
    inputs = _inputs(dtype)
    gm = _graph(fn, inputs)
    before = fn(*inputs)  # the IR ops bound to the references: bit-identical after fusion
    fuse = pass_cls()
    fuse(gm.graph)
    gm.recompile()
    assert fuse.matched == 1
    targets = _targets(gm)
    assert fused in targets and "kiln.dynamic_int8_quant.default" not in targets
    for got, want in zip(gm(*inputs), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn, pass_cls", [(normed_used_twice, FuseNormQuant),
                                          (act_used_twice, FuseActQuant)],
                         ids=["normed-second-user", "activation-second-user"])
def test_no_match_where_the_intermediate_has_a_second_user(fn, pass_cls):
    gm = _graph(fn, _inputs())
    before = _targets(gm)
    fuse = pass_cls()
    fuse(gm.graph)
    assert fuse.matched == 0 and _targets(gm) == before


def test_mm_act_quant_matches_after_act_quant_and_keeps_every_bit():
    inputs = _mm_inputs()
    gm = _graph(mm_act_quant, inputs)
    before = mm_act_quant(*inputs)
    act, mm = FuseActQuant(), FuseMmActQuant()
    mm(gm.graph)
    assert mm.matched == 0  # the SiLU-and-mul + quant op is fuse_act_quant's to make
    act(gm.graph)
    mm(gm.graph)
    gm.recompile()
    assert (act.matched, mm.matched) == (1, 1)
    assert _targets(gm).count("kiln.int8_scaled_mm_panels_silu_quant.default") == 1
    assert not {"kiln.int8_scaled_mm_panels.default",
                "kiln.silu_and_mul_dynamic_int8_quant.default"} & set(_targets(gm))
    for got, want in zip(gm(*inputs), before):
        assert torch.equal(got, want)


def test_mm_act_quant_leaves_a_projection_with_a_second_user():
    gm = _graph(mm_used_twice, _mm_inputs())
    FuseActQuant()(gm.graph)
    before = _targets(gm)
    fuse = FuseMmActQuant()
    fuse(gm.graph)
    assert fuse.matched == 0 and _targets(gm) == before


def noops(x, res, w):
    y = x.reshape(x.shape[0], x.shape[1])  # same shape
    z = y[:, 0:]  # every element
    c = z.clone()
    return (c * 2).view(-1), x.view(-1, 2)  # the last view changes the shape: kept


def test_eliminate_noops_removes_what_changes_nothing():
    inputs = _inputs(torch.float32)
    gm = _graph(noops, inputs)
    before = noops(*inputs)
    p = EliminateNoops()
    p(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert p.matched >= 2, targets  # the reshape and the slice (make_fx may drop one itself)
    assert "aten.slice.Tensor" not in targets
    assert targets.count("aten.view.default") == 2  # the two shape-changing views stay
    for got, want in zip(gm(*inputs), before):
        assert torch.equal(got, want)
