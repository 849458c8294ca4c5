"""The native CPU provider of the MoE ops (kiln/ir/moe_native.py) against their references:
float32 within 1e-5 and bfloat16 within a rounding step of the output (rtol 2^-7, atol 2e-2: only
the GEMMs' summation order differs: AMX-BF16 tiles where granted, else the multi-row kernel
(csrc/rows_gemm.c, AVX-512) up to its rows, else GEMV up to 4 rows an expert, and aten's GEMM);
int8 bit for bit with the experts as stored and packed into panels. Shapes include no tokens, a
single token, k = 1, 2, 8, experts no token chose and the tiles' row and width edges; float
experts run in one C++ call a layer and are held once.
"""
import pytest
import torch

from kiln import ir
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.moe_cpu import int8_expert_weight, pack_int8_experts
from kiln.model.layers.quantization.moe_int8 import quantize_experts
from kiln.native import build, int8_ops, linear_op

pytestmark = pytest.mark.skipif(not build.available(), reason="no C++ compiler")

E, K = 6, 2


def _experts(hidden: int, inter: int, dtype: torch.dtype, idle: int | None = None):
    """A FusedMoE of random weights; expert `idle` (which no token will choose) all NaN."""
    moe = FusedMoE(E, K, hidden, inter, renormalize=True, tp_rank=0, tp_size=1)
    g = torch.Generator().manual_seed(hidden + inter)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(E, 2 * inter, hidden, generator=g) * 0.2)
        moe.w2_weight.copy_(torch.randn(E, hidden, inter, generator=g) * 0.2)
        if idle is not None:
            moe.w13_weight[idle] = float("nan")
    return moe.to(dtype)


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, idle: int | None = None):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, E, generator=g).to(dtype)
    if idle is not None:
        logits[:, idle] = -1e4
    return x, logits


def _close(got, want, dtype):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter, tokens, idle", [(64, 96, 1, None), (64, 96, 2, 4),
                                                        (48, 40, 0, None), (48, 40, 37, 1),
                                                        (128, 64, 130, None)])
def test_float_provider_matches_the_reference(dtype, hidden, inter, tokens, idle):
    moe = _experts(hidden, inter, dtype, idle)
    x, logits = _inputs(tokens, hidden, dtype, idle)
    args = (x, logits, moe.w13_weight, moe.w2_weight, K, True)
    want = ir.fused_moe.reference(*args)
    native = ir.fused_moe.impls["native"]
    assert native.supported(*args)
    got = native.fn(*args)
    _close(got, want, dtype)
    assert torch.isfinite(got).all()  # the NaN expert no token chose never ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_one_native_call_runs_every_expert(dtype, top_k, tokens):
    """k = 1, 2, 8 of 10 experts, the routing given as DeepSeek's is (not renormalized), for a
    decode's token, a few (experts side by side, each on the GEMV kernel) and a prefill's (aten's
    GEMM above 4 rows): one call of the C++ kernel, no per-expert dense linear dispatched."""
    experts = 10
    g = torch.Generator().manual_seed(top_k * 100 + tokens)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * 48, 64, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, 64, 48, generator=g) * 0.2).to(dtype)
    w2[9] = float("nan")  # expert 9 is never chosen: its weights are never read
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    args = (x, x.new_empty(tokens, experts), w13, w2, top_k, False, weights, ids)
    want = ir.fused_moe.reference(*args)
    calls, linears = torch.ops.kiln.fused_experts_calls(), linear_op.path_counts()
    got = ir.fused_moe.impls["native"].fn(*args)
    assert torch.ops.kiln.fused_experts_calls() == calls + 1
    assert linear_op.path_counts() == linears
    _close(got, want, dtype)


GEMV, TILES, ATEN, ROWS = 0, 1, 2, 3  # csrc/moe_experts.cpp's routes
NONE, AVX512F, BF16_DOT = 0, 1, 2  # csrc/kernels.h's KILN_ROWS_* (kiln_rows_gemm_isa)


def test_an_experts_rows_choose_its_kernel():
    """bfloat16 on AMX tiles where granted, from one row. Else the rows kernel where the build has
    one: bfloat16 on AVX512-BF16 dot products up to 4 rows, widened (AVX-512F alone) at any
    rows, float32 up to 16; above them aten. Without AVX-512 the GEMV kernel up to 4 rows, aten
    above."""
    route = torch.ops.kiln.fused_experts_route
    for isa in (NONE, AVX512F, BF16_DOT):
        assert [route(r, 1, True, isa) for r in (1, 4, 5, 16, 17, 33, 512)] == [TILES] * 7
    for dtype in (0, 1):
        assert [route(r, dtype, False, NONE) for r in (1, 4, 5, 33)] == [GEMV, GEMV, ATEN, ATEN]
    assert [route(r, 1, False, BF16_DOT) for r in (1, 4, 5, 8, 9, 512)] == [ROWS] * 2 + [ATEN] * 4
    assert [route(r, 1, False, AVX512F) for r in (1, 33, 512, 4096)] == [ROWS] * 4
    for tiles in (True, False):  # float32
        assert [route(r, 0, tiles, AVX512F) for r in (1, 16, 17, 33)] == [ROWS, ROWS, ATEN, ATEN]
    has = {"amx_tile", "amx_bf16", "avx512_bf16"} <= build.cpu_flags()
    assert torch.ops.kiln.fused_experts_tiles() == has


def _route_of(rows: int, dtype: torch.dtype) -> int:
    """The route this build takes for an expert of `rows` rows."""
    code = build.DTYPES[dtype]
    return torch.ops.kiln.fused_experts_route(rows, code, torch.ops.kiln.fused_experts_tiles(),
                                              torch.ops.kiln.fused_experts_rows_isa(code))


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("hidden, inter", [(64, 96), (80, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_at_the_row_boundaries(rows, hidden, inter, dtype):
    """`rows` rows to expert 0 (the others fewer), on widths that fill whole 32 x 32 tile blocks
    and on ones that leave edges (k and weight rows past a tile's end: zero-padded copies; past
    the rows kernel's 4 x 4 blocks and 16 / 32 k a step), on this build's route for them."""
    experts = 4
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.zeros(rows, dtype=torch.long), 1 + torch.arange(rows) % 3], 1)
    weights = torch.rand(rows, 2, generator=g)
    want = ir.fused_moe.reference(x, x.new_empty(rows, experts), w13, w2, 2, False, weights, ids)
    before = torch.ops.kiln.fused_experts_route_counts()
    got = torch.ops.kiln.fused_experts_native(x, weights, ids, w13, w2)
    ran = [a - b for a, b in zip(torch.ops.kiln.fused_experts_route_counts(), before)]
    assert ran[_route_of(rows, dtype)] >= 1 and sum(ran) == min(rows, 3) + 1
    _close(got, want, dtype)


def test_the_kernel_names_a_bad_expert_id():
    x, w13, w2 = torch.randn(2, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    with pytest.raises(IndexError, match="expert 3, past the 3 experts"):
        torch.ops.kiln.fused_experts_native(x, torch.ones(2, 1), torch.tensor([[0], [3]]), w13,
                                            w2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter, tokens, idle", [(64, 96, 1, None), (48, 40, 0, None),
                                                        (48, 40, 37, 2), (128, 64, 130, None)])
def test_int8_provider_equals_the_reference_as_stored_and_packed(dtype, hidden, inter, tokens,
                                                                 idle):
    moe = _experts(hidden, inter, torch.float32)
    quantize_experts(moe)
    if idle is not None:  # an expert no token chose: garbage scales that would poison a sum
        moe.w13_weight_scale.data[idle] = float("nan")
    x, logits = _inputs(tokens, hidden, dtype, idle)
    args = (x, logits, moe.w13_weight, moe.w13_weight_scale, moe.w2_weight,
            moe.w2_weight_scale, K, True)
    want = ir.fused_moe_int8.reference(*args)
    stored = ir.fused_moe_int8.impls["native"]
    if not stored.supported(*args):  # no AVX512-VNNI: the reference runs
        assert int8_ops.isa() is None
        return
    assert torch.equal(stored.fn(*args), want)
    w13 = moe.w13_weight.data
    assert pack_int8_experts(moe) and moe.w13_weight.is_meta
    assert torch.equal(int8_expert_weight(moe, "w13"), w13)
    panels = (x, logits, moe.w13_panels, moe.w13_weight_scale, moe.w2_panels,
              moe.w2_weight_scale, K, True)
    assert ir.fused_moe_int8_panels.impls["native"].supported(*panels)
    got = ir.fused_moe_int8_panels.impls["native"].fn(*panels)
    assert torch.equal(got, want) and torch.equal(ir.fused_moe_int8_panels.reference(*panels), want)
    assert torch.isfinite(got).all()
    assert torch.equal(moe(x, logits), got)  # the layer calls the panels op once packed


def test_only_cpu_tensors_take_the_native_provider():
    """Off the CPU (CUDA, where graphs record the torch provider's dense form) the native
    provider declines, and the selection keeps the reference."""
    moe = _experts(64, 96, torch.float32)
    x, logits = _inputs(3, 64, torch.float32)
    meta = [t.to("meta") for t in (x, logits, moe.w13_weight, moe.w2_weight)]
    assert not ir.fused_moe.impls["native"].supported(*meta, K, True)
    assert ir.fused_moe.impls["native"].supported(x, logits, moe.w13_weight, moe.w2_weight, K,
                                                  True)


def test_a_loaded_model_holds_its_float_experts_once(tiny_mixtral_dir):
    """No second (oneDNN-packed) copy of the float experts: the kernel reads them as stored."""
    from kiln.model.loader import get_model
    from model._attn_helper import kiln_config_for

    model = get_model(kiln_config_for(tiny_mixtral_dir))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(not hasattr(m, "cpu_packed") for m in experts)
    held = [t for m in experts for t in (*m.parameters(), *m.buffers())]
    assert all(not t.is_mkldnn for t in held)
    assert sum(t.numel() for t in held) == sum(m.w13_weight.numel() + m.w2_weight.numel()
                                               for m in experts)


def _int8_stacks(experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(experts, 2, hidden, inter, renormalize=False, tp_rank=0, tp_size=1)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2)
        moe.w2_weight.copy_(torch.randn(experts, hidden, inter, generator=g) * 0.2)
    quantize_experts(moe)
    return moe


def _dense_int8_ops_per_expert(packed: bool, x, w13, w13_scale, w2, w2_scale, top_k, weights,
                               ids):
    """What the provider ran before its one C++ call: routed_sum over each expert's dense int8
    ops (quant, gate_up GEMM, SiLU-and-mul + quant, down GEMM), called one by one."""
    from kiln.ir.moe import routed_sum

    k = torch.ops.kiln
    gemm = k.int8_scaled_mm_panels_native if packed else k.int8_scaled_mm_native

    def mlp(e, xe):
        q, scale = k.dynamic_int8_quant_native(xe)
        if packed:
            q, scale = k.int8_scaled_mm_panels_silu_quant_native(q, scale, w13[e], w13_scale[e],
                                                                 None, xe.dtype)
        else:
            q, scale = k.silu_and_mul_dynamic_int8_quant_native(
                gemm(q, scale, w13[e], w13_scale[e], None, xe.dtype))
        return gemm(q, scale, w2[e], w2_scale[e], None, xe.dtype)
    return routed_sum(x, None, w13.shape[0], w2_scale.shape[1], mlp, top_k, False, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter", [(64, 48), (80, 40)])
def test_int8_experts_run_in_one_call_at_the_row_boundaries(dtype, hidden, inter):
    """Experts of 0, 1, 12 and 13 rows (AMX-INT8 tiles from 12 where granted) and one of 283
    (the fused gate_up + SiLU + quant's row blocks from 256), each token's other choice that
    one, first or second in its slots; then a decode's few tokens over all experts (side by side
    on the threads): one C++ call a layer, as stored and packed, bit for bit the dense int8 ops
    run per expert. Those equal the reference in bfloat16; in float32 the native SiLU's expf
    can be an ulp off torch's (a row's scale then is), so there within a rounding step."""
    if int8_ops.isa() is None:  # no AVX512-VNNI: the reference runs
        return
    moe = _int8_stacks(6, hidden, inter, hidden)
    g = torch.Generator().manual_seed(inter)
    chosen = torch.tensor([1] * 1 + [2] * 12 + [3] * 13 + [4] * 257)
    chosen = chosen[torch.randperm(len(chosen), generator=g)]
    tokens = len(chosen)
    ids = torch.stack([chosen, torch.full_like(chosen, 5)], 1)
    ids[::3] = ids[::3].flip(1)  # the larger id first in some tokens' slots
    routings = [(ids, torch.rand(tokens, 2, generator=g)),
                (torch.stack([torch.randperm(6, generator=g) for _ in range(3)]),
                 torch.rand(3, 6, generator=g))]
    stored = (moe.w13_weight.data, moe.w13_weight_scale, moe.w2_weight.data, moe.w2_weight_scale)
    assert pack_int8_experts(moe)
    packed = (moe.w13_panels, moe.w13_weight_scale, moe.w2_panels, moe.w2_weight_scale)
    for ids, weights in routings:
        x = torch.randn(ids.shape[0], hidden, generator=g).to(dtype)
        top_k = ids.shape[1]
        logits = x.new_empty(ids.shape[0], 6)
        want = ir.fused_moe_int8.reference(x, logits, *stored, top_k, False, weights, ids)
        for op, w in ((ir.fused_moe_int8, stored), (ir.fused_moe_int8_panels, packed)):
            args = (x, logits, *w, top_k, False, weights, ids)
            native = op.impls["native"]
            assert native.supported(*args)
            calls = torch.ops.kiln.fused_experts_int8_calls()
            got = native.fn(*args)
            assert torch.ops.kiln.fused_experts_int8_calls() == calls + 1
            assert torch.equal(got, _dense_int8_ops_per_expert(
                op is ir.fused_moe_int8_panels, x, *w, top_k, weights, ids)), op.name
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), op.name
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_int8_kernel_names_what_does_not_fit():
    moe = _int8_stacks(3, 8, 4, 0)
    x, weights = torch.randn(2, 8), torch.ones(2, 1)
    args = (moe.w13_weight.data, moe.w13_weight_scale, moe.w2_weight.data, moe.w2_weight_scale)
    with pytest.raises(IndexError, match="expert 3, past the 3 experts"):
        torch.ops.kiln.fused_experts_int8_native(x, weights, torch.tensor([[0], [3]]), *args,
                                                 False)
    with pytest.raises(ValueError, match=r"panels: uint8 \[E, ceil\(N / 64\), K / 4, 64, 4\]"):
        torch.ops.kiln.fused_experts_int8_native(x, weights, torch.tensor([[0], [1]]), *args,
                                                 True)
