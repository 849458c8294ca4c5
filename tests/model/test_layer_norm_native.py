"""The native provider of the LayerNorm families' ops (layer_norm, fused_add_layer_norm, gelu;
kiln/native/csrc/layer_norm.c) against the references, on odd widths and strided rows; that
the models' default choice on this CPU is it; and Cohere's norm rounding as HF's does.

Tolerances: float32 within 1e-5 relative, 1e-6 absolute (the statistics summed in another
order; GELU's erfc / exp within a few ulp, where torch's own erf form loses digits in the
negative tail); bfloat16 within one bfloat16 rounding step (rtol 2^-7, atol 1e-2).
"""
import pytest
import torch

from kiln import ir

DTYPES = [torch.float32, torch.bfloat16]


def close(got, want, dtype):
    got, want = got.float(), want.float()
    assert got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)


def _native(op, *args):
    assert op.supported_by("native", *args)
    return op.impls["native"].fn(*args), op.reference(*args)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as the last columns of a wider tensor (rows strided, offset)."""
    wide = torch.full((t.shape[0], t.shape[1] + 5), float("nan"), dtype=t.dtype)
    wide[:, 5:] = t
    return wide[:, 5:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden, strided", [(1, 64, False), (3, 63, True),
                                                   (70, 577, False), (5, 1, False)])
def test_layer_norm_with_and_without_bias_and_residual(dtype, rows, hidden, strided):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 1).to(dtype)  # far from zero mean
    x = _strided(x) if strided else x
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w, b = (torch.randn(hidden, generator=g).to(dtype) for _ in range(2))
    for bias in (b, None):
        close(*_native(ir.layer_norm, x, w, bias, 1e-5), dtype)
        (got, total), (want, want_total) = _native(ir.fused_add_layer_norm, x, res, w, bias,
                                                   1e-5)
        assert torch.equal(total, want_total)  # the add rounds once, the same way
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows, d", [(1, 64), (3, 95), (70, 257)])
def test_gelu_erf_and_tanh(dtype, approximate, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=g) * 4).to(dtype)
    x[0, :min(d, 4)] = torch.tensor([0.0, -12.0, 12.0, -3.5])[:min(d, 4)].to(dtype)
    close(*_native(ir.gelu, _strided(x), approximate), dtype)


def test_cohere_head_norm_shape_and_empty_batches():
    """Cohere's q / k norm is layer_norm over [T, heads, head_dim] in float32; no tokens give
    empty results of the right shapes."""
    x, unit = torch.randn(7, 4, 24), torch.ones(24)
    close(*_native(ir.layer_norm, x, unit, None, 1e-5), torch.float32)
    e = torch.randn(0, 64)
    assert _native(ir.layer_norm, e, torch.ones(64), None, 1e-5)[0].shape == (0, 64)
    got, total = _native(ir.fused_add_layer_norm, e, e, torch.ones(64), None, 1e-5)[0]
    assert got.shape == total.shape == (0, 64)
    assert _native(ir.gelu, e, "tanh")[0].shape == (0, 64)


def test_native_refuses_what_it_does_not_take():
    """float16, a float32 weight on bfloat16 x (torch's mixed layer_norm) or a weight of the
    wrong size go to the reference."""
    x = torch.randn(2, 64)
    assert not ir.layer_norm.supported_by("native", x.half(), torch.ones(64).half(), None, 1e-5)
    assert not ir.layer_norm.supported_by("native", x.bfloat16(), torch.ones(64), None, 1e-5)
    assert not ir.layer_norm.supported_by("native", x, torch.ones(32), None, 1e-5)
    assert not ir.layer_norm.supported_by("native", x, torch.ones(64), torch.ones(32), 1e-5)
    assert not ir.fused_add_layer_norm.supported_by("native", x, x[:1], torch.ones(64), None,
                                                    1e-5)
    assert not ir.gelu.supported_by("native", x.half(), "none")
    assert not ir.gelu.supported_by("native", x, "sigmoid")
    assert not ir.gelu.supported_by("native", x[0, 0], "none")  # 0-dim: no rows
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        torch.ops.kiln.gelu_native(x, "sigmoid")
    with pytest.raises(ValueError, match="bias has 32 values for hidden size 64"):
        torch.ops.kiln.layer_norm_native(x, torch.ones(64), torch.ones(32), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_families_take_the_native_provider_here(dtype):
    """On this CPU the default choice for every op the LayerNorm families call is the native
    kernel (it was the torch reference only)."""
    from kiln.model import registry

    chosen = ir.resolve({}, "cpu", dtype).as_dict()
    for arch in ("Starcoder2ForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM",
                 "CohereForCausalLM"):
        used = set(registry._FAMILY_OPS[arch]) & {"layer_norm", "fused_add_layer_norm", "gelu"}
        assert used and {chosen[op] for op in used} == {"native"}, arch


def test_cohere_layer_norm_rounds_once_as_hfs_float32_norm():
    """HF's CohereLayerNorm normalises and scales in float32 and rounds once; Kiln's bfloat16
    norm (either provider) does too: within one bfloat16 step of HF's, equal in most values,
    where rounding the normalised value before the weight (as Llama's RMSNorm does) is not."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm as HFCohereLayerNorm

    from kiln.model.cohere import CohereLayerNorm

    g = torch.Generator().manual_seed(5)
    hidden = 576
    x = (torch.randn(64, hidden, generator=g) * 3 + 0.5).bfloat16()
    hf = HFCohereLayerNorm(hidden, eps=1e-5).bfloat16()
    kiln_norm = CohereLayerNorm(hidden, eps=1e-5).bfloat16()
    with torch.no_grad():
        hf.weight.copy_(1 + torch.randn(hidden, generator=g) * 0.3)
        kiln_norm.weight.copy_(hf.weight)
        want = hf(x)
        for provider in ("native", "torch"):
            got = ir.layer_norm.impls[provider].fn(x, kiln_norm.weight, None, 1e-5)
            close(got, want, torch.bfloat16)
            assert (got != want).float().mean() < 0.005, provider
        got = kiln_norm(x)  # the module as the model calls it
        assert (got != want).float().mean() < 0.005
        twice = ir.layer_norm.reference(x, torch.ones_like(hf.weight), None, 1e-5) * hf.weight
        assert (twice != want).float().mean() > 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_erf_form_is_torchs_kernel(dtype):
    """The erf form runs torch's own kernel (twice as fast here as the C loop over libmvec's
    erfcf): bit for bit F.gelu's, strides too; the tanh form stays Kiln's."""
    x = (torch.randn(3, 40, 33) * 4).to(dtype).transpose(0, 1)  # dense, permuted
    got = torch.ops.kiln.gelu_native(x, "none")
    want = torch.nn.functional.gelu(x)
    assert torch.equal(got, want) and got.stride() == want.stride()
