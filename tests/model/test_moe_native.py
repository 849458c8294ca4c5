"""The native CPU provider of the MoE ops (kiln/ir/moe_native.py) against their references:
float32 within 1e-5 and bfloat16 within a rounding step of the output (only the GEMMs' summation
order differs: GEMV for 1-2 rows, oneDNN's packed GEMM above); int8 bit for bit with the
experts as stored and packed into panels. Shapes include no tokens, a single token and experts no
token chose; the fast kernels are the ones that run; a model loads its experts packed.
"""
import pytest
import torch

from kiln import ir
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.moe_cpu import int8_expert_weight, pack_float_experts, pack_int8_experts
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
    _close(native.fn(*args), want, dtype)  # the dense weights alone (GEMV, else aten)
    assert pack_float_experts(moe) and len(moe.cpu_packed) == 2 * E
    got = native.fn(*args, moe.cpu_packed)
    _close(got, want, dtype)
    assert torch.isfinite(got).all()  # the NaN expert no token chose never ran
    # a sleeping engine's empty stand-ins for stale copies (kiln/worker/sleep_mode.py) are not
    # read as packed weights
    _close(native.fn(*args, [torch.empty(0)] * (2 * E)), want, dtype)


def test_experts_run_on_the_dense_linears_fast_paths():
    """One token: each of its experts' GEMMs is the GEMV kernel; 64 tokens: oneDNN's packed
    GEMM (never aten's dense linear, the reference's)."""
    moe = _experts(64, 96, torch.bfloat16)
    assert pack_float_experts(moe)
    for tokens, path in ((1, "gemv"), (64, "packed")):
        x, logits = _inputs(tokens, 64, torch.bfloat16)
        before = linear_op.path_counts()
        moe(x, logits)
        after = linear_op.path_counts()
        ran = {p: after[p] - before[p] for p in after if after[p] != before[p]}
        assert set(ran) == {path} and ran[path] >= 2  # gate_up and down of each chosen expert


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


def test_a_loaded_model_packs_its_experts(tiny_mixtral_dir):
    from kiln.model.loader import get_model
    from model._attn_helper import kiln_config_for

    model = get_model(kiln_config_for(tiny_mixtral_dir))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(len(m.cpu_packed) == 2 * m.num_experts for m in experts)
