"""The prefill profile's pure parts: which projection a linear call is, an op's category, the
attribution of nested ops' time, and the ceilings a faster GEMM would give."""
from types import SimpleNamespace

import pytest

from kiln.benchmarks import prefill_profile as pp

# SmolLM2-135M: 9 query heads and 3 kv heads of 64
DIMS = {"hidden": 576, "intermediate": 1536, "q_size": 576, "kv_size": 192, "vocab": 49152}


@pytest.mark.parametrize("out_in,want", [((960, 576), "qkv"), ((576, 576), "o"),
                                         ((3072, 576), "gate_up"), ((576, 1536), "down"),
                                         ((49152, 576), "lm_head"), ((7, 576), "linear_7x576")])
def test_projection_by_shape(out_in, want):
    assert pp.projection(*out_in, DIMS) == want


def test_category_reads_each_kernels_operands():
    # the int8 panel op: x [M, K], scale, panels [N / 64, K / 4, 64, 4], w_scale [N]
    assert pp.category("kiln::int8_scaled_mm_panels_native",
                       [[2048, 576], [2048, 1], [15, 144, 64, 4], [960], [], []], DIMS) == "qkv"
    assert pp.category("kiln::int8_scaled_mm_panels_silu_quant_native",
                       [[2048, 576], [2048, 1], [48, 144, 64, 4], [3072], [], []],
                       DIMS) == "gate_up"
    # a GGUF layer's blocks [N, bytes] come before its dense copy [N, K]
    assert pp.category("kiln::gguf_linear_native",
                       [[2048, 1536], [576, 1152], [], [], [], [], [576, 1536], [3]],
                       DIMS) == "down"
    assert pp.category("aten::_int_mm", [[64, 576], [576, 960]], DIMS) == "qkv"
    assert pp.category("kiln::fused_add_rms_norm_dynamic_int8_quant_native",
                       [[2048, 576]], DIMS) == "quant"
    assert pp.category("kiln::fused_add_rms_norm_native_", [[2048, 576]], DIMS) == "norm"
    assert pp.category("kiln::prefill_attention", [], DIMS) == "attention"
    assert pp.category("aten::narrow", [[2048, 960]], DIMS) is None
    assert pp.category("## Call CompiledFxGraph x ##", [], DIMS) is None


def _event(name, us, shapes=(), children=()):
    e = SimpleNamespace(name=name, cpu_time_total=us, input_shapes=list(shapes),
                        cpu_children=list(children), cpu_parent=None)
    for c in children:
        c.cpu_parent = e
    return e


def test_attribute_gives_a_fused_norm_its_time_less_the_linear_it_calls():
    inner = _event("mkldnn::_linear_pointwise", 70, [[2048, 576], [960, 576]])
    fused = _event("kiln::add_rms_norm_linear", 100, [[2048, 576], [960, 576]],
                   [inner, _event("aten::empty", 5)])
    stray = _event("aten::copy_", 4, [], [_event("aten::empty", 1)])
    graph = _event("## Call CompiledFxGraph g ##", 130, [], [fused, stray])
    events = [graph, fused, inner, stray, *fused.cpu_children[1:], *stray.cpu_children]
    got = pp.attribute(events, DIMS)
    # the norm fused before the linear keeps its time less the linear's
    assert got == {"qkv": 70.0, "norm": 30.0, "other_ops": 4.0}


def test_ceilings():
    quant = {"step_cpu_ms": 100.0, "ms": {"qkv": 10.0, "o": 5.0, "gate_up": 30.0, "down": 15.0}}
    base = {"step_cpu_ms": 160.0, "ms": {"qkv": 20.0, "o": 10.0, "gate_up": 60.0, "down": 30.0}}
    got = pp.ceilings(quant, base, ("qkv", "o", "gate_up", "down"))
    assert got["speedup"] == 1.6 and got["linear_ms"] == 60.0
    assert got["speedup_linears_free"] == 4.0  # 160 / (100 - 60)
    assert got["speedup_linears_2x_unquantized"] == 1.6  # 160 / (40 + 120 / 2)
