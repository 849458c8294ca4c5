"""Every implementation of every IR layer op against the op's reference (kiln/ir/layer_ops.py),
on random shapes with the edges: one row, odd widths, head sizes 64 / 80 / 128, GQA ratios,
strided inputs. float32 within 1e-5 relative (linear: of the output's largest value, the sums
being taken in another order); bfloat16 within one bfloat16 rounding step (rtol 2^-7, atol
1e-2), where a sum of squares in another order can tip it. The attention op's implementations
are checked against a float64 softmax in tests/native/test_fuzz_attention.py.
"""
import pytest
import torch

from kiln import ir
from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear
from kiln.native import build, layer_ops, linear_op

DTYPES = [torch.float32, torch.bfloat16]
LAYER_OPS = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "linear"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def close(got, want, dtype, *, scale_by_max=False):
    got, want = (torch.as_tensor(t).float() for t in (got, want))
    assert got.shape == want.shape
    if dtype == torch.float32:
        if scale_by_max:
            assert (got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)


def _providers(name):
    return sorted(ir.REGISTRY[name].impls)


def test_every_layer_op_has_a_native_implementation_that_builds():
    # A kernel that does not build on a machine with a compiler is a failure here, not a skip.
    assert build.compiler() is not None and build.available()
    for name in LAYER_OPS:
        assert _providers(name) == ["native", "torch"], name


def _run(name, provider, *args):
    op = ir.REGISTRY[name]
    assert op.supported_by(provider, *args), f"{provider} does not take these {name} arguments"
    return op.impls[provider].fn(*args), op.reference(*args)


def _strided(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """t itself, or the same values as the first columns of a wider tensor (rows strided, as
    the q / k slices of a fused qkv projection are)."""
    if not strided:
        return t
    out = torch.cat([t, torch.full_like(t, float("nan"))], 1)[:, :t.shape[1]]
    assert out.stride(0) == 2 * t.shape[1]
    return out


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden, strided", [(1, 64, False), (3, 63, True), (130, 576, False),
                                                   (5, 1, False)])
def test_rms_norm(provider, dtype, rows, hidden, strided):
    g = _gen(rows * hidden)
    x = _strided(torch.randn(rows, hidden, generator=g).to(dtype), strided)
    w = torch.randn(hidden, generator=g).to(dtype)
    got, want = _run("rms_norm", provider, x, w, 1e-5)
    close(got, want, dtype)
    res = _strided(torch.randn(rows, hidden, generator=g).to(dtype), strided)
    (got, got_sum), (want, want_sum) = _run("fused_add_rms_norm", provider, x, res, w, 1e-6)
    assert torch.equal(got_sum, want_sum)  # the add rounds once, the same way
    close(got, want, dtype)


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_row_whose_squares_overflow_is_zero_as_torchs(provider, dtype):
    """Squares past float32's range: torch's rsqrt(inf) is 0. A kernel that computed 1/sqrt as
    -ffast-math's rsqrt estimate with a Newton step got 0 * inf = NaN for every value; the
    portable kernel (no AVX-512), reassociated to (x * w) * 0, NaN where x * w overflows (the
    second row; tests/native/test_isa_tiers.py runs that kernel)."""
    x = torch.tensor([[1e20, 1.0], [3e38, -1.0], [3.0, 4.0]]).to(dtype)
    got, want = _run("rms_norm", provider, x, torch.tensor([2.0, -3.0], dtype=dtype), 1e-6)
    assert not got.isnan().any() and torch.equal(got[:2], want[:2]) and (got[:2] == 0).all()
    close(got, want, dtype)


@pytest.mark.parametrize("provider", ["native", "torch"])
def test_rms_norm_per_head_view(provider):
    # Qwen3 normalises each head of a [T, heads, hd] view of q.
    x, w = torch.randn(4, 3, 16, generator=_gen(1)), torch.rand(16, generator=_gen(2))
    got, want = _run("rms_norm", provider, x, w, 1e-6)
    assert got.shape == (4, 3, 16)
    close(got, want, torch.float32)


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d, strided", [(1, 48, False), (7, 37, True), (70, 48, False)])
def test_silu_and_mul(provider, dtype, rows, d, strided):
    x = _strided(torch.randn(rows, 2 * d, generator=_gen(d)).to(dtype) * 4, strided)
    got, want = _run("silu_and_mul", provider, x)
    close(got, want, dtype)


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """t's values in storage one element further on (another alignment)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [37, 100, 576, 1536])
def test_native_norm_and_silu_rows_do_not_depend_on_the_call(dtype, width):
    """A row's bits are the same alone, in a chunk or among many rows (threaded from 64), and at
    any alignment: the fused int8 kernels call these on 16-row chunks into their own scratch and
    must equal the unfused op bit for bit. A vector and a scalar expf differ in the last bit, as
    do sums of squares added in another order: no value may take another path (a scalar tail,
    a peel for alignment)."""
    assert build.available()
    g, rows = _gen(width), 130
    x = torch.randn(rows, 2 * width, generator=g).to(dtype) * 4
    res = torch.randn(rows, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    silu = layer_ops.silu_and_mul(x)
    norm = layer_ops.rms_norm(x[:, :width], w, 1e-6)
    fused, total = layer_ops.rms_norm(x[:, :width], w, 1e-6, res)
    for r0, r1 in [(0, 1), (5, 6), (rows - 1, rows), (17, 33), (3, 70)]:
        part = x[r0:r1]
        for xs in (part, _shifted(part)):
            assert torch.equal(layer_ops.silu_and_mul(xs), silu[r0:r1])
            assert torch.equal(layer_ops.rms_norm(xs[:, :width], w, 1e-6), norm[r0:r1])
            got, got_total = layer_ops.rms_norm(_shifted(xs[:, :width]), w, 1e-6,
                                                _shifted(res[r0:r1]))
            assert torch.equal(got, fused[r0:r1]) and torch.equal(got_total, total[r0:r1])


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, nq, nk", [(64, 4, 4), (80, 6, 2), (128, 7, 1), (32, 4, 2)])
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_on_strided_q_and_k(provider, dtype, head_size, nq, nk, tokens, is_neox):
    from kiln.model.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(head_size, max_position=256, base=10000.0)
    g = _gen(head_size + nq)
    qkv = torch.randn(tokens, (nq + 2 * nk) * head_size, generator=g).to(dtype)
    q, k, _ = qkv.split([nq * head_size, nk * head_size, nk * head_size], dim=-1)
    positions = torch.randint(0, 256, (tokens,), generator=g)
    (gq, gk), (wq, wk) = _run("rotary_embedding", provider, positions, q, k, rope.cos_sin_cache,
                              head_size, is_neox)
    close(gq, wq, dtype)
    close(gk, wk, dtype)


@pytest.mark.parametrize("provider", ["native", "torch"])
def test_rotary_gptj_layout_rotates_interleaved_pairs(provider):
    from kiln.model.layers.rotary_embedding import RotaryEmbedding

    hd = 64
    rope = RotaryEmbedding(hd, max_position=16, base=10000.0)
    q, k = torch.randn(3, 2 * hd), torch.randn(3, hd)
    args = (torch.tensor([0, 1, 5]), q, k, rope.cos_sin_cache, hd, False)
    (gq, _), _ = _run("rotary_embedding", provider, *args)
    # pairs (x[2i], x[2i+1]) rotate by position * inv_freq[i]: check one by hand
    angle = 5 * rope.inv_freq[3]
    x1, x2 = q[2, 6], q[2, 7]
    want = torch.stack([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])
    torch.testing.assert_close(gq[2, 6:8], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gq[0], q[0])  # position 0 does not rotate


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 33])  # GEMV (1-2 rows), oneDNN's packed GEMM
@pytest.mark.parametrize("bias", [False, True])
def test_linear_dense_and_prepacked(provider, dtype, rows, bias):
    layer = ReplicatedLinear(96, 40, bias=bias).to(dtype)
    g = _gen(rows)
    layer.weight.data.copy_(torch.randn(40, 96, generator=g))
    if bias:
        layer.bias.data.copy_(torch.randn(40, generator=g))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    b = layer.bias if bias else None
    got, want = _run("linear", provider, x, layer.weight, b)
    close(got, want, dtype, scale_by_max=True)
    if provider == "native":
        assert cpu_gemm.prepack_for_cpu(layer) == 1
        before = linear_op.path_counts()
        got, _ = _run("linear", provider, x, *cpu_gemm.linear_call(layer, b)[1])
        after = linear_op.path_counts()
        assert after["gemv" if rows <= 2 else "packed"] == (
            before["gemv" if rows <= 2 else "packed"] + 1)
        close(got, want, dtype, scale_by_max=True)


def test_native_refuses_what_it_does_not_support():
    x = torch.randn(2, 64, dtype=torch.float64)
    assert not ir.rms_norm.supported_by("native", x, torch.ones(64, dtype=torch.float64), 1e-6)
    assert not ir.rms_norm.supported_by("native", torch.randn(2, 64), torch.ones(32), 1e-6)
    assert not ir.silu_and_mul.supported_by("native", torch.randn(2, 63))
    assert not ir.linear.supported_by("native", torch.randn(2, 8), torch.randn(4, 8).double())
    assert ir.rms_norm.supported_by("torch", x, torch.ones(64, dtype=torch.float64), 1e-6)


def test_rotary_position_outside_the_cache_is_an_index_error():
    from kiln.model.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(8, max_position=16, base=10000.0)
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    for provider in ("native", "torch"):
        with pytest.raises(IndexError):
            ir.rotary_embedding.impls[provider].fn(torch.tensor([3, 16]), q, k,
                                                   rope.cos_sin_cache, 8, True)


def test_shapes_the_kernels_would_read_past_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight has 32 values for hidden size 64"):
        layer_ops.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match=r"residual shape .2, 32. != x shape .2, 64."):
        layer_ops.rms_norm(x, torch.ones(64), 1e-6, residual=torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"last dimension \(63\) must be even"):
        layer_ops.silu_and_mul(torch.randn(2, 63))
    with pytest.raises(ValueError, match="head_size must be even, got 3"):
        layer_ops.rotary(torch.tensor([0, 1]), torch.randn(2, 6), torch.randn(2, 3),
                         torch.randn(16, 3), 3)


@pytest.mark.parametrize("provider", ["native", "torch"])
@pytest.mark.parametrize("is_neox", [True, False])
def test_every_layer_op_takes_a_batch_of_no_tokens(provider, is_neox):
    """Zero rows give empty results of the right shapes. The torch reference's rotary reshaped
    to [T, -1, ...], which torch refuses at T = 0 (-1 is then ambiguous)."""
    hd = 64
    x, w = torch.randn(0, hd), torch.randn(hd)
    assert _run("rms_norm", provider, x, w, 1e-6)[0].shape == (0, hd)
    got, total = _run("fused_add_rms_norm", provider, x, x.clone(), w, 1e-6)[0]
    assert got.shape == total.shape == (0, hd)
    assert _run("silu_and_mul", provider, x)[0].shape == (0, hd // 2)
    cache = torch.randn(16, hd)
    for (q, k) in _run("rotary_embedding", provider, torch.zeros(0, dtype=torch.long),
                       torch.randn(0, 3 * hd), torch.randn(0, hd), cache, hd, is_neox):
        assert q.shape == (0, 3 * hd) and k.shape == (0, hd)


_WIDE_ROW = """
import torch
from kiln.native import build, layer_ops
assert build.available()
x, w = torch.randn(2, 1 << 22), torch.ones(1 << 22)
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
tol = dict(rtol=1e-4, atol=1e-5)  # 4M squares summed in another order
torch.testing.assert_close(layer_ops.rms_norm(x[:1], w, 1e-6), want[:1], **tol)
got, total = layer_ops.rms_norm(x, w, 1e-6, residual=torch.zeros_like(x))
torch.testing.assert_close(got, want, **tol)
from kiln.native import int8_ops
if int8_ops.isa():  # the fused quant kernel norms its chunks of rows with the same kernel
    q, s = int8_ops.rms_norm_dynamic_int8_quant(x, w, 1e-6)
    uq, us = int8_ops.dynamic_int8_quant(layer_ops.rms_norm(x, w, 1e-6))
    assert torch.equal(q, uq) and torch.equal(s, us)
print("ok")
"""


def test_native_rms_norm_of_a_row_wider_than_a_stack():
    """A row of 4M values (16 MB of float32 scratch) is normed on the heap: the kernel kept each
    row's values in a variable-length array on the stack, and the process died (SIGSEGV)."""
    import subprocess
    import sys

    assert build.available()
    proc = subprocess.run([sys.executable, "-c", _WIDE_ROW], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rotary_equals_the_reference_bit_for_bit(dtype, is_neox):
    """Each product rounded, then the sum, as torch's ops do: in float32 -ffast-math contracted
    x1 * cos - x2 * sin into one FMA, 1 ulp off in a quarter of the values."""
    g = _gen(7)
    hd = 128
    positions = torch.randint(0, 64, (33,), generator=g)
    q, k = (torch.randn(33, n * hd, generator=g).to(dtype) for n in (4, 2))
    cache = torch.randn(64, hd, generator=g)
    (gq, gk), (wq, wk) = _run("rotary_embedding", "native", positions, q, k, cache, hd, is_neox)
    assert torch.equal(gq, wq) and torch.equal(gk, wk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_ops_round_as_hf_gemma_does(dtype):
    """Gemma's norm scales by (1 + w) in float32 and rounds after (Llama's rounds, then
    scales), and its GeGLU is gelu_pytorch_tanh: the references equal HF's modules bit for bit
    in bfloat16 too, where folding 1 + w into a plain rms_norm weight would not."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = _gen(7)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    hf_norm = GemmaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(96, generator=g) * 0.3)
        want = hf_norm(x)
        assert torch.equal(ir.rms_norm_f32_scale.reference(x, hf_norm.weight, 1e-6, 1.0), want)
        got, total = ir.fused_add_rms_norm_f32_scale.reference(x, res, hf_norm.weight,
                                                                  1e-6, 1.0)
        assert torch.equal(total, x + res) and torch.equal(got, hf_norm(x + res))
        gate, up = x[:, :48], x[:, 48:]
        assert torch.equal(ir.gelu_tanh_and_mul.reference(x),
                           ACT2FN["gelu_pytorch_tanh"](gate) * up)
    if dtype == torch.bfloat16:  # a plain rms_norm with 1 + w as its weight rounds elsewhere
        folded = ir.rms_norm.reference(x, (1 + hf_norm.weight.float()).to(dtype), 1e-6)
        assert not torch.equal(folded, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_and_gelu_equal_hf_modules(dtype):
    """StarCoder2 / GPT-NeoX's ops: layer_norm is HF's nn.LayerNorm (bias included) and gelu
    each hidden_act those families name, bit for bit in bfloat16 too; the partial rope rotates
    the first dims of each head as HF's GPT-NeoX does, passing the rest through."""
    from transformers.activations import ACT2FN
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    from kiln.model.layers.activation import GELU_APPROXIMATIONS
    from kiln.model.layers.rotary_embedding import PartialRotaryEmbedding

    g = _gen(11)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    hf_norm = torch.nn.LayerNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + torch.randn(96, generator=g) * 0.3)
        hf_norm.bias.copy_(torch.randn(96, generator=g) * 0.3)
        assert torch.equal(ir.layer_norm.reference(x, hf_norm.weight, hf_norm.bias, 1e-5),
                           hf_norm(x))
        for act, approximate in GELU_APPROXIMATIONS.items():
            if act in ("gelu", "gelu_pytorch_tanh"):  # gelu_new / gelu_fast: HF's own rounding
                assert torch.equal(ir.gelu.reference(x, approximate), ACT2FN[act](x)), act
            else:
                close(ir.gelu.reference(x, approximate), ACT2FN[act](x), dtype)
    rope = PartialRotaryEmbedding(16, 4, 64, 10000.0)
    positions = torch.tensor([0, 3, 7])
    q, k = torch.randn(3, 4 * 16, generator=g), torch.randn(3, 2 * 16, generator=g)
    got_q, got_k = rope(positions, q, k)
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)  # HF's cos / sin: halves doubled
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # [T, 4]
    want_q, want_k = apply_rotary_pos_emb(q.view(3, 4, 16), k.view(3, 2, 16), cos, sin)
    close(got_q, want_q.reshape(3, -1), torch.float32)
    close(got_k, want_k.reshape(3, -1), torch.float32)
    empty = rope(torch.zeros(0, dtype=torch.long), torch.randn(0, 64), torch.randn(0, 32))
    assert [t.shape for t in empty] == [(0, 64), (0, 32)]
