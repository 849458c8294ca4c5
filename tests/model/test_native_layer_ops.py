"""The fused C layer kernels (kiln/native/layer_ops.py) against the layers' own torch code.

float32 agrees to rounding; bfloat16 rounds where torch does, so it agrees bit for bit or within
one bf16 step where summation order differs.
"""
import pytest
import torch

from kiln.model.layers.activation import SiluAndMul
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.layers.rotary_embedding import RotaryEmbedding
from kiln.native import layer_ops

pytestmark = pytest.mark.skipif(layer_ops._lib() is None,
                                reason="no C compiler: the CPU layer kernels cannot be built")
DTYPES = [torch.float32, torch.bfloat16]


def torch_path(monkeypatch, fn, *args):
    """fn(*args) with the kernels turned off, i.e. through the layer's torch code."""
    with monkeypatch.context() as m:
        m.setenv("KILN_NATIVE_CPU_OPS", "0")
        assert not layer_ops.usable(args[-1])
        return fn(*args)


def close(a, b, dtype):
    if dtype == torch.float32:
        return torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    # bf16: one rounding step apart at most (a sum of squares in another order can tip it)
    return torch.allclose(a.float(), b.float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 130])  # one thread, and the OpenMP path
def test_rms_norm_with_and_without_residual(monkeypatch, dtype, rows):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x, res = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    assert layer_ops.usable(x, norm.weight)
    assert close(norm(x), torch_path(monkeypatch, norm, x), dtype)
    got_out, got_res = norm(x, res)
    ref_out, ref_res = torch_path(monkeypatch, norm, x, res)
    assert torch.equal(got_res, ref_res)  # the add rounds once, the same way
    assert close(got_out, ref_out, dtype)


def test_rms_norm_per_head_view(monkeypatch):
    # Qwen3 normalises each head of a [T, heads, hd] view of q.
    x = torch.randn(4, 3, 16)
    norm = RMSNorm(16)
    norm.weight.data = torch.rand(16)
    got = norm(x)
    assert got.shape == (4, 3, 16)
    assert close(got, torch_path(monkeypatch, norm, x), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(monkeypatch, dtype):
    x = torch.randn(70, 2 * 48, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    act = SiluAndMul()
    assert close(act(x), torch_path(monkeypatch, act, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_q_and_k(monkeypatch, dtype):
    nq, nk, hd = 4, 2, 32
    rope = RotaryEmbedding(hd, max_position=256, base=10000.0)
    qkv = torch.randn(9, (nq + 2 * nk) * hd, generator=torch.Generator().manual_seed(2)).to(dtype)
    q, k, _ = qkv.split([nq * hd, nk * hd, nk * hd], dim=-1)  # column slices, as the model has
    positions = torch.tensor([0, 1, 2, 100, 5, 255, 7, 8, 9])
    got_q, got_k = rope(positions, q, k)
    ref_q, ref_k = torch_path(monkeypatch, rope, positions, q, k)
    assert close(got_q, ref_q, dtype) and close(got_k, ref_k, dtype)


def test_traced_forward_keeps_the_torch_code():
    # Under torch.compile the layer must trace to aten ops (Inductor fuses them), not a C call.
    norm = RMSNorm(8)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(norm, backend=backend, fullgraph=True)(torch.randn(2, 8))
    assert any("rsqrt" in t for t in seen)


def test_rotary_position_outside_the_cache_is_an_index_error():
    rope = RotaryEmbedding(8, max_position=16, base=10000.0)
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    with pytest.raises(IndexError, match=r"outside \[0, 16\)"):
        rope(torch.tensor([3, 16]), q, k)


def test_rotary_odd_head_size_is_named_not_taken_for_a_bad_position():
    q, k, cache = torch.randn(2, 6), torch.randn(2, 3), torch.randn(16, 3)
    with pytest.raises(ValueError, match="head_size must be even, got 3"):
        layer_ops.rotary(torch.tensor([0, 1]), q, k, cache, 3)


def test_shapes_the_kernels_would_read_past_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight has 32 values for hidden size 64"):
        layer_ops.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match=r"residual shape \(2, 32\) != x shape \(2, 64\)"):
        layer_ops.rms_norm(x, torch.ones(64), 1e-6, residual=torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"last dimension \(63\) must be even"):
        layer_ops.silu_and_mul(torch.randn(2, 63))
