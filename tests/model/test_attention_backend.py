"""The portable torch attention backend and the unified_attention op, on random tensors.

Checks paths against a dense reference: per-request, batched decode, padding, no-metadata warm-up.
"""
import torch
import torch.nn.functional as F

from kiln.attention.backend import get_attn_backend, kv_cache_shape
from kiln.attention.torch_backend import TorchAttentionImpl, write_kv_cache
from kiln.config import CompilationConfig, set_current_kiln_config
from kiln.forward_context import set_forward_context
from model._attn_helper import BlockPool, PagedRequest, build_step

NH, NKV, HD, BS = 4, 2, 8, 4


def dense_reference(q, k, v):
    """Causal attention of one whole sequence: q [S, NH, HD], k/v [S, NKV, HD] -> [S, NH, HD]."""
    k = k.repeat_interleave(NH // NKV, dim=1)
    v = v.repeat_interleave(NH // NKV, dim=1)
    s = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD ** -0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(lengths_per_step: list[list[int]], total: list[int], num_padding: int = 0):
    """Feed random q/k/v for each step; returns the final step's output and expected rows."""
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randn(n, NH, HD, generator=g), torch.randn(n, NKV, HD, generator=g),
             torch.randn(n, NKV, HD, generator=g)) for n in total]
    impl = TorchAttentionImpl(NH, HD, HD ** -0.5, NKV)
    cache = torch.zeros(kv_cache_shape(32, BS, NKV, HD))
    pool = BlockPool(32, BS)
    reqs = [PagedRequest(list(range(n))) for n in total]
    for step, q_lens in enumerate(lengths_per_step):
        pad = num_padding if step == len(lengths_per_step) - 1 else 0
        starts = [r.num_computed for r in reqs]
        _, _, md = build_step(pool, reqs, q_lens, num_padding=pad)
        parts = [[t[s:s + n] for t in seq] for seq, s, n in zip(seqs, starts, q_lens)]
        q, k, v = (torch.cat([p[i] for p in parts] + [torch.full((pad,) + parts[0][i].shape[1:],
                                                                  7.0)]) for i in range(3))
        out = torch.empty(q.shape[0], NH * HD)
        impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    expected = [dense_reference(*seq)[s:s + n] for seq, s, n in zip(seqs, starts, q_lens)]
    return out.view(-1, NH, HD), torch.cat(expected), cache, md


def test_chunked_and_mixed_match_dense():
    out, expected, _, _ = run_steps([[5, 3, 7], [6, 1, 2]], total=[11, 4, 9])
    assert torch.allclose(out, expected, atol=1e-5)


def test_uniform_decode_fast_path_matches_dense():
    out, expected, _, md = run_steps([[6, 13, 2], [1, 1, 1]], total=[7, 14, 3])
    assert md.uniform_decode
    assert torch.allclose(out, expected, atol=1e-5)


def test_padding_tokens_write_nothing_and_output_zero():
    out, expected, cache, md = run_steps([[5, 3]], total=[5, 3], num_padding=4)
    n = md.num_actual_tokens
    assert torch.allclose(out[:n], expected, atol=1e-5)
    assert torch.all(out[n:] == 0)
    assert not torch.any(cache == 7.0)  # the padding rows' k/v never reach the cache


def test_write_kv_cache_skips_negative_slots():
    cache = torch.zeros(kv_cache_shape(2, BS, NKV, HD))
    k = torch.ones(3, NKV, HD)
    write_kv_cache(k, 2 * k, cache, torch.tensor([5, -1, 0]))
    assert cache[0].view(-1, NKV, HD)[[0, 5]].eq(1).all()
    assert cache[1].view(-1, NKV, HD)[[0, 5]].eq(2).all()
    assert cache.view(2, -1, NKV, HD)[:, [1, 2, 3, 4, 6, 7]].eq(0).all()


def test_backend_interface():
    backend = get_attn_backend()
    assert backend.supports_full_cudagraph is False
    assert backend.get_impl_cls() is TorchAttentionImpl
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


class _FakeKilnConfig:
    def __init__(self):
        self.compilation_config = CompilationConfig()


def test_op_traces_under_compile_and_uses_context():
    from kiln.model.layers.attention import Attention

    cfg = _FakeKilnConfig()
    with set_current_kiln_config(cfg):
        layer = Attention(NH, HD, HD ** -0.5, NKV, prefix="layers.0.attn")
    assert cfg.compilation_config.static_forward_context["layers.0.attn"] is layer
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, h * HD, generator=g) for h in (NH, NKV, NKV))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with set_forward_context(None, cfg):
        got = compiled(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.view(6, NH, HD).transpose(0, 1), k.view(6, NKV, HD).transpose(0, 1),
        v.view(6, NKV, HD).transpose(0, 1), is_causal=True, enable_gqa=True)
    assert torch.allclose(got, ref.transpose(0, 1).reshape(6, -1), atol=1e-5)
