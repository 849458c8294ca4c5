"""The native provider's in-place kernels (what compiled graphs call where
kiln/compilation/passes/reinplace_ir_ops.py proved the inputs theirs) against the IR references:
rotary on the strided q/k of a QKV output (head sizes 64 / 80 / 128, GQA, one token, odd head
counts), the residual-add RMSNorm; float32 bitwise equal to the functional native kernel and
within 1e-5 of the reference, bfloat16 within one rounding step. Also the wrappers' conversions
that the fast paths skip when nothing needs converting.
"""
import pytest
import torch

from kiln import ir
from kiln.model.layers.rotary_embedding import RotaryEmbedding
from kiln.native import build
from model.test_ir_ops import DTYPES, close

kiln = torch.ops.kiln


@pytest.fixture(autouse=True, scope="module")
def _library():
    # the kernels must build on a machine with a compiler: a failure here, never a skip
    assert build.available()


def _qkv(tokens, nq, nk, head_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (nq + 2 * nk) * head_size, generator=g).to(dtype)
    return qkv, torch.randint(0, 256, (tokens,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, nq, nk", [(64, 4, 4), (80, 5, 1), (128, 7, 1), (64, 9, 3)])
@pytest.mark.parametrize("tokens", [1, 9, 70])  # 70: the kernel's threaded loop
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_in_place_on_the_qkv_output(dtype, head_size, nq, nk, tokens, is_neox):
    rope = RotaryEmbedding(head_size, max_position=256, base=10000.0)
    qkv, positions = _qkv(tokens, nq, nk, head_size, dtype, head_size + nq + tokens)
    sizes = [nq * head_size, nk * head_size, nk * head_size]
    q, k, v = qkv.split(sizes, dim=-1)
    v_before = v.clone()
    args = (positions, q, k, rope.cos_sin_cache, head_size, is_neox)
    want_q, want_k = ir.rotary_embedding.reference(*args)
    fq, fk = kiln.rotary_embedding_native(*args)
    assert ir.rotary_embedding.impls["native"].inplace.supported(*args)
    kiln.rotary_embedding_native_(*args)
    assert torch.equal(q, fq) and torch.equal(k, fk)  # the same kernel, written where q/k lie
    assert torch.equal(v, v_before)  # the columns beside them untouched
    close(q, want_q, dtype)
    close(k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (3, 63), (130, 576)])
def test_fused_add_rms_norm_in_place(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x, res = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    want, want_sum = ir.fused_add_rms_norm.reference(x, res, w, 1e-6)
    f_norm, f_sum = kiln.fused_add_rms_norm_native(x, res, w, 1e-6)
    assert ir.fused_add_rms_norm.impls["native"].inplace.supported(x, res, w, 1e-6)
    kiln.fused_add_rms_norm_native_(x, res, w, 1e-6)
    assert torch.equal(x, f_norm) and torch.equal(res, f_sum)
    assert torch.equal(res, want_sum)
    close(x, want, dtype)


def test_fused_add_rms_norm_in_place_on_strided_x_rows():
    base = torch.randn(4, 128)
    x, res, w = base[:, :64], torch.randn(4, 64), torch.randn(64)
    want, want_sum = ir.fused_add_rms_norm.reference(x, res, w, 1e-6)
    rest = base[:, 64:].clone()
    kiln.fused_add_rms_norm_native_(x, res, w, 1e-6)
    close(x, want, torch.float32)
    assert torch.equal(res, want_sum) and torch.equal(base[:, 64:], rest)


def test_in_place_forms_refuse_layouts_they_cannot_write():
    rope = RotaryEmbedding(64, max_position=16, base=10000.0)
    cache = rope.cos_sin_cache
    q, k = torch.randn(2, 128), torch.randn(2, 64)
    supported = ir.rotary_embedding.impls["native"].inplace.supported
    assert not supported(torch.tensor([0, 1], dtype=torch.int32), q, k, cache, 64, True)
    assert not supported(torch.tensor([0, 1]), q.double(), k.double(), cache, 64, True)
    assert not supported(torch.tensor([0, 1]), torch.randn(2, 256)[:, ::2], k, cache, 64, True)
    fused = ir.fused_add_rms_norm.impls["native"].inplace.supported
    x = torch.randn(3, 64)
    assert not fused(x, torch.randn(3, 128)[:, :64], torch.randn(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous columns"):
        kiln.rotary_embedding_native_(torch.tensor([0, 1]), torch.randn(2, 256)[:, ::2], k,
                                      cache, 64, True)
    with pytest.raises(ValueError, match="residual's contiguous"):
        kiln.fused_add_rms_norm_native_(x, torch.randn(3, 128)[:, :64], torch.randn(64), 1e-6)


def test_functional_wrappers_still_convert_what_the_fast_path_skips():
    rope = RotaryEmbedding(64, max_position=16, base=10000.0)
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    positions = torch.tensor([0, 7, 15])
    want = kiln.rotary_embedding_native(positions, q, k, rope.cos_sin_cache, 64, True)
    wide = torch.cat([rope.cos_sin_cache, rope.cos_sin_cache], 1)[:, :64]  # strided rows
    for pos, cache in [(positions.int(), rope.cos_sin_cache), (positions, wide),
                       (positions, rope.cos_sin_cache.double())]:
        got = kiln.rotary_embedding_native(pos, q, k, cache, 64, True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    x3 = torch.randn(2, 3, 64)  # [..., hidden]: reshaped to rows
    w = torch.randn(64)
    assert torch.equal(kiln.rms_norm_native(x3, w, 1e-6),
                       kiln.rms_norm_native(x3.reshape(6, 64), w, 1e-6).view(2, 3, 64))
