"""The pass `reinplace_ir_ops` on lowered graphs: where the graph owns what a native kernel would
overwrite it calls the in-place form (outputs bitwise equal to the functional graph, float32),
and it leaves alone an input read after the op, a graph input or a view of one, overlapping
arguments and layouts or dtypes the in-place kernel does not take. In Inductor's code the
rotary then writes into the QKV output's buffer: no buffer of its own, no copy."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.compilation.passes import PostGradPassManager, ReinplaceIrOps
from kiln.model.layers.rotary_embedding import RotaryEmbedding
from kiln.native import build

kiln = torch.ops.kiln
HD, NQ, NK = 64, 3, 1
SIZES = [NQ * HD, NK * HD, NK * HD]
CACHE = RotaryEmbedding(HD, max_position=64, base=10000.0).cos_sin_cache


@pytest.fixture(autouse=True, scope="module")
def _library():
    assert build.available()  # a failure, never a skip, on a machine with a compiler


def attention_in(pos, x, w, cache):
    q, k, v = (x @ w).split(SIZES, dim=-1)  # [T, (nq + 2 nk) * hd] -> views
    q, k = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q, k, v


def q_read_after(pos, x, w, cache):
    qkv = x @ w
    q, k, v = qkv.split(SIZES, dim=-1)
    q2, k2 = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q2, k2, v, q * 2


def base_read_after(pos, x, w, cache):
    qkv = x @ w
    q, k, _ = qkv.split(SIZES, dim=-1)
    q2, k2 = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q2, k2, qkv.sum(-1)


def unsafe_view_read_after(pos, x, w, cache):
    qkv = x @ w
    flat = torch.ops.aten._unsafe_view(qkv, [-1])  # shares qkv's storage; its schema says not
    q, k, v = qkv.split(SIZES, dim=-1)
    q2, k2 = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q2, k2, v, flat * 2


def unbind_read_after(pos, x, w, cache):
    qkv = x @ w
    rows = qkv.unbind()  # a multi-output view with no sizes argument (once an IndexError)
    q, k, v = qkv.split(SIZES, dim=-1)
    q2, k2 = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q2, k2, v, rows[0] + 1


def rotary_of_inputs(pos, x, w, cache):
    return kiln.rotary_embedding_native(pos, x[:, :NQ * HD], x[:, NQ * HD:(NQ + NK) * HD],
                                        cache, HD, True)


def overlapping_q_k(pos, x, w, cache):
    qkv = x @ w
    return kiln.rotary_embedding_native(pos, qkv[:, :NQ * HD], qkv[:, HD:(NK + 1) * HD],
                                        cache, HD, True)


def strided_columns(pos, x, w, cache):
    qkv = torch.cat([x @ w, x @ w], -1)
    return kiln.rotary_embedding_native(pos, qkv[:, :2 * NQ * HD:2], qkv[:, -NK * HD:], cache,
                                        HD, True)


def final_norm(x, res, w1, w2, nw):
    normed, total = kiln.fused_add_rms_norm_native(x @ w1, res @ w2, nw, 1e-6)
    return normed, total


def norm_of_one_base(x, res, w1, w2, nw):
    h = torch.cat([x @ w1, res @ w2], -1)  # x and residual: disjoint column views of one buffer
    return kiln.fused_add_rms_norm_native(h[:, :64], h[:, 64:], nw, 1e-6)


def residual_is_an_input(x, res, w1, w2, nw):
    return kiln.fused_add_rms_norm_native(x @ w1, res, nw, 1e-6)


def x_read_after(x, res, w1, w2, nw):
    h = x @ w1
    normed, total = kiln.fused_add_rms_norm_native(h, res @ w2, nw, 1e-6)
    return normed, total, h + 1


def _rotary_inputs(dtype=torch.float32, tokens=5, pos_dtype=torch.int64):
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, sum(SIZES), generator=g), torch.randn(sum(SIZES), sum(SIZES),
                                                                     generator=g) / 16
    pos = torch.randint(0, 64, (tokens,), generator=g).to(pos_dtype)
    return pos, x.to(dtype), w.to(dtype), CACHE


def _norm_inputs(dtype=torch.float32, rows=4):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 48, generator=g), torch.randn(rows, 64, generator=g)
    w1, w2 = torch.randn(48, 64, generator=g), torch.randn(64, 64, generator=g)
    return x.to(dtype), res.to(dtype), w1.to(dtype), w2.to(dtype), torch.randn(64).to(dtype)


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _run_pass(fn, inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    before = _targets(gm)
    reinplace = ReinplaceIrOps()
    reinplace(gm.graph)
    gm.recompile()
    return gm, before, reinplace.matched


@pytest.mark.parametrize("fn, inputs, inplace_op", [
    (attention_in, _rotary_inputs(), "kiln.rotary_embedding_native_.default"),
    (attention_in, _rotary_inputs(tokens=1), "kiln.rotary_embedding_native_.default"),
    (final_norm, _norm_inputs(), "kiln.fused_add_rms_norm_native_.default"),
    (attention_in, _rotary_inputs(torch.bfloat16), "kiln.rotary_embedding_native_.default"),
    (final_norm, _norm_inputs(torch.bfloat16), "kiln.fused_add_rms_norm_native_.default"),
    # one row: the residual's row stride (128 here) is never read; the kernel once refused it
    (norm_of_one_base, _norm_inputs(rows=1), "kiln.fused_add_rms_norm_native_.default"),
], ids=["rotary", "rotary-1-token", "fused-add-rms-norm", "rotary-bf16", "norm-bf16",
        "norm-one-row-of-one-base"])
def test_owned_inputs_are_overwritten_with_bitwise_equal_outputs(fn, inputs, inplace_op):
    gm, before, matched = _run_pass(fn, inputs)
    after = _targets(gm)
    assert matched == 1
    assert inplace_op in after and inplace_op[:-9] + ".default" not in after
    assert len(after) < len(before)  # the functional node and its getitems are gone
    want = fn(*inputs)
    got = gm(*inputs)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("fn, inputs", [
    (q_read_after, _rotary_inputs()),
    (base_read_after, _rotary_inputs()),
    (unsafe_view_read_after, _rotary_inputs()),
    (unbind_read_after, _rotary_inputs()),
    (rotary_of_inputs, _rotary_inputs()),
    (overlapping_q_k, _rotary_inputs()),
    (strided_columns, _rotary_inputs()),
    (attention_in, _rotary_inputs(pos_dtype=torch.int32)),
    (attention_in, _rotary_inputs(torch.float64)),
    (residual_is_an_input, _norm_inputs()),
    (x_read_after, _norm_inputs()),
    (final_norm, _norm_inputs(torch.float64)),
], ids=["q-read-after", "base-read-after", "unsafe-view-read-after", "unbind-read-after",
        "graph-input-views", "q-k-overlap", "strided-columns", "int32-positions", "float64",
        "residual-is-input", "x-read-after", "norm-float64"])
def test_inputs_the_graph_does_not_own_are_left_alone(fn, inputs):
    gm, before, matched = _run_pass(fn, inputs)
    assert matched == 0 and _targets(gm) == before


def q_read_before(pos, x, w, cache):
    q, k, v = (x @ w).split(SIZES, dim=-1)
    doubled = q * 2  # before the rotary in graph order, though its kernel may come later
    q, k = kiln.rotary_embedding_native(pos, q, k, cache, HD, True)
    return q, k, v, doubled


def _inductor(fn, inputs, **options):
    from torch._inductor.utils import run_and_get_code

    manager = PostGradPassManager()
    manager.add(ReinplaceIrOps())
    compiled = torch.compile(fn, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_pre_pass": manager,
                                      "fx_graph_cache": False, **options})
    got, (code,) = run_and_get_code(compiled, *inputs)
    return got, code, manager


def test_inductor_computes_earlier_readers_before_the_write():
    inputs = _rotary_inputs(tokens=6)
    want = q_read_before(*inputs)
    # kept where it is written (Inductor would move it next to its use, after the rotary, and
    # the pass then leaves the rotary functional)
    got, code, manager = _inductor(q_read_before, inputs, reorder_for_locality=False)
    assert manager.runs[-1]["matches"] == {"ReinplaceIrOps": 1}
    assert code.index("cpp_fused_mul") < code.index("rotary_embedding_native_.default(")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_inductor_writes_the_rotary_into_the_qkv_buffer():
    inputs = _rotary_inputs(tokens=6)
    want = attention_in(*inputs)
    got, code, manager = _inductor(attention_in, inputs)
    assert manager.runs[-1]["matches"] == {"ReinplaceIrOps": 1}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "rotary_embedding_native_.default(" in code
    assert "rotary_embedding_native.default(" not in code
    # q, k and v are views of the matmul's buffer (its one allocation): none of their own, no copy
    assert code.split("def call")[1].count("empty_strided") == 1
    assert got[2].data_ptr() - got[0].data_ptr() == (NQ + NK) * HD * 4


def test_the_pass_is_on_by_default_named_in_pass_config_and_keyed():
    from types import SimpleNamespace

    from kiln.compilation.passes import late_passes
    from kiln.config import CompilationConfig

    def passes(pass_config):
        return late_passes(SimpleNamespace(
            compilation_config=CompilationConfig(pass_config=pass_config)))

    assert [type(p) for p in passes({})] == [ReinplaceIrOps]
    assert passes({"reinplace_ir_ops": False}) == []
    with pytest.raises(ValueError, match="pass_config.reinplace_ir_ops must be true or false"):
        passes({"reinplace_ir_ops": "yes"})  # refused by the config, before any pass runs
    on, off = PostGradPassManager({}), PostGradPassManager({"reinplace_ir_ops": False})
    on.add(ReinplaceIrOps())
    assert on.uuid() != off.uuid()  # Inductor's cache key and Kiln's (compiler hash)
