"""MLA's chunked context (kiln/attention/mla_context_chunks.py, lse_merge.py, mla_prefill.py), as
vLLM's chunked-context workspace: the chunk plan as a pure function (every context token once,
no chunk over the workspace), the workspace's default size, attention merged by log-sum-exp
against attention over all keys, and a step of several prefill requests over cached contexts of
different lengths (plus a fresh prompt and a decode) expanded 5 context tokens at a time equal to
the unchunked expanded form within float32 rounding (TOL); a bfloat16 context a token a chunk
no further from float64 than unchunked bfloat16, and the off-CPU math attention a bounded block
of queries at a time.
"""
import pytest
import torch

from kiln.attention.lse_merge import (
    attention_with_lse,
    math_attention_with_lse,
    merge_attn_states,
)
from kiln.attention.mla_backend import LatentAttentionImpl, latent_cache_shape
from kiln.attention.mla_context_chunks import (
    MAX_WORKSPACE_TOKENS,
    ContextSlice,
    default_workspace_tokens,
    plan_context_chunks,
)
from kiln.attention.mla_prefill import MLADims, chunked_context_attention, expanded_attention
from model._attn_helper import BlockPool, PagedRequest, build_step

TOL = 1e-5


def _covered(plan, context_lens, workspace):
    """Each request's slices tile its context front to back; no chunk over the workspace."""
    seen = {i: 0 for i in range(len(context_lens))}
    for chunk in plan:
        assert 0 < sum(s.length for s in chunk) <= workspace
        for s in chunk:
            assert s.length > 0 and s.start == seen[s.request]
            seen[s.request] += s.length
    assert [seen[i] for i in range(len(context_lens))] == list(context_lens)


def test_plan_fills_chunks_shortest_first():
    # 10 a piece, then C's 5 left leave room for A's and B's 15 and 20
    assert plan_context_chunks([30, 40, 15], 30) == [
        [ContextSlice(0, 0, 10), ContextSlice(1, 0, 10), ContextSlice(2, 0, 10)],
        [ContextSlice(0, 10, 12), ContextSlice(1, 10, 13), ContextSlice(2, 10, 5)],
        [ContextSlice(0, 22, 8), ContextSlice(1, 23, 17)],
    ]
    assert plan_context_chunks([0, 7, 0], 100) == [[ContextSlice(1, 0, 7)]]
    assert plan_context_chunks([0, 0], 4) == []
    assert plan_context_chunks([], 4) == []


@pytest.mark.parametrize("context_lens, workspace", [
    ([7, 13, 22], 5), ([1, 1, 1, 1, 1], 2), ([100], 7), ([3, 0, 64, 9], 16), ([5, 6], 1),
])
def test_plan_covers_every_context_token_within_the_workspace(context_lens, workspace):
    _covered(plan_context_chunks(context_lens, workspace), context_lens, workspace)


def test_plan_refuses_an_empty_workspace():
    with pytest.raises(ValueError, match="workspace_tokens must be >= 1, got 0"):
        plan_context_chunks([4], 0)


def test_default_workspace_is_bounded_by_bytes_and_vllms_cap():
    # DeepSeek-V3 at 128 heads in bfloat16: 128 * 2 * 192 * 2 bytes a token
    assert default_workspace_tokens(128, 192, 2) == 2730
    assert default_workspace_tokens(4, 24, 4) == MAX_WORKSPACE_TOKENS
    assert default_workspace_tokens(10**6, 192, 4) == 1


@pytest.mark.parametrize("attend", [attention_with_lse, math_attention_with_lse])
def test_lse_merge_of_split_keys_is_attention_over_all(attend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 8, generator=g) for _ in range(3))
    full = torch.softmax(q @ k.transpose(1, 2) * 0.4, dim=-1) @ v
    o, lse = merge_attn_states(*attend(q, k[:, :2], v[:, :2], 0.4, False),
                               *attend(q, k[:, 2:], v[:, 2:], 0.4, False))
    assert (o - full).abs().max() < TOL
    assert (lse - (q @ k.transpose(1, 2) * 0.4).logsumexp(-1)).abs().max() < TOL
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4)
    assert (attend(q, k, v, 0.4, True)[0] - causal).abs().max() < TOL
    # a side with no keys (lse -inf) passes the other through
    empty = torch.full((3, 5), float("-inf"))
    assert torch.equal(merge_attn_states(o, lse, torch.zeros_like(o), empty)[0], o)
    # no keys at all: that empty side itself (CPU torch's flash kernel died of SIGFPE on it)
    none = attend(q, k[:, :0], v[:, :0], 0.4, False)
    assert torch.equal(none[1], empty) and not none[0].any()
    assert torch.equal(merge_attn_states(o, lse, *none)[0], o)


def _fill_context(pool, req, cache, context_len, g):
    """Random latent rows in the cache slots of req's first context_len tokens."""
    pool.ensure(req, context_len)
    bs = pool.block_size
    rows = cache.view(-1, cache.shape[-1])
    for p in range(context_len):
        rows[req.blocks[p // bs] * bs + p % bs] = torch.randn(cache.shape[-1], generator=g)


def test_chunked_context_equals_unchunked_expansion():
    """Prefill requests over 7, 13 and 22 cached tokens, a fresh prompt and a decode in one
    step; 5 context tokens expanded at a time (chunks of several requests' slices) against
    each request's whole context and step rows expanded at once (the unchunked form)."""
    dims, scale = MLADims(num_heads=4, nope=16, rope=8, latent=32, v_dim=12), 0.2
    g = torch.Generator().manual_seed(1)
    w = torch.randn(dims.num_heads * (dims.nope + dims.v_dim), dims.latent, generator=g) * 0.2
    kv_cache = torch.zeros(latent_cache_shape(48, 4, 1, dims.latent + dims.rope))
    pool = BlockPool(48, 4)
    contexts, query_lens = [7, 0, 13, 9, 22], [3, 5, 4, 1, 6]
    reqs = [PagedRequest(list(range(c + n)), num_computed=c)
            for c, n in zip(contexts, query_lens)]
    for req, c in zip(reqs, contexts):
        _fill_context(pool, req, kv_cache[0], c, g)
    _, _, md = build_step(pool, reqs, query_lens)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, dims.num_heads * dims.qk_dim, generator=g)
    k = torch.randn(num_tokens, dims.latent + dims.rope, generator=g)

    def run(workspace):
        impl = LatentAttentionImpl(dims, scale, lambda: w)
        impl.workspace_tokens = workspace
        cache, out = kv_cache.clone(), torch.empty(num_tokens, dims.num_heads * dims.v_dim)
        md.step_cache.clear()
        impl.forward(q, k, k, cache, md, out)
        return out.view(num_tokens, dims.num_heads, dims.v_dim), cache, md.step_cache

    got, cache, step_cache = run(5)
    assert len(step_cache[("mla_chunks", 5)]) == 9  # ceil((7 + 13 + 22) / 5): all full but one
    once, _, _ = run(10**6)
    rows = cache[0].view(-1, dims.latent + dims.rope)
    qh = q.view(num_tokens, dims.num_heads, dims.qk_dim)
    start = 0
    for req, c, n in zip(reqs, contexts, query_lens):
        if n > 1:  # prefill: the unchunked expanded form over the context then the step's rows
            slots = [req.blocks[p // 4] * 4 + p % 4 for p in range(c + n)]
            want = expanded_attention(qh[start:start + n], rows[slots], w, dims, scale)
            assert (got[start:start + n] - want).abs().max() < TOL
        start += n
    assert (got - once).abs().max() < TOL


def test_bfloat16_chunks_merge_without_drift():
    """A bfloat16 context expanded a token a chunk: the merged state stays float32 between
    merges, so its error against float64 is the unchunked bfloat16 form's (rounded at every
    merge it was 14x that over the 300 here)."""
    dims, scale, ctx = MLADims(num_heads=4, nope=16, rope=8, latent=32, v_dim=16), 0.2, 300
    g = torch.Generator().manual_seed(2)
    w = torch.randn(dims.num_heads * (dims.nope + dims.v_dim), dims.latent, generator=g) * 0.2
    rows = torch.randn(ctx + 4, dims.latent + dims.rope, generator=g)
    q = torch.randn(4, dims.num_heads, dims.qk_dim, generator=g)
    want = expanded_attention(q.double(), rows.double(), w.double(), dims, scale)
    bf = torch.bfloat16
    chunks = [(chunk, rows[chunk[0].start:chunk[0].start + 1].to(bf))
              for chunk in plan_context_chunks([ctx], 1)]
    got = chunked_context_attention([q.to(bf)], [rows[ctx:].to(bf)], chunks, w.to(bf), dims,
                                    scale)[0]
    once = expanded_attention(q.to(bf), rows.to(bf), w.to(bf), dims, scale)
    assert got.dtype == bf
    assert (got.double() - want).abs().max() <= 1.5 * (once.double() - want).abs().max()


@pytest.mark.parametrize("causal", [True, False])
def test_math_attention_holds_a_bounded_block_of_scores(causal, monkeypatch):
    """Off CPU the scores are materialized: a block of queries at a time within SCORE_BYTES
    (a request's own rows are L x L; at 16 heads and 8192 tokens they were 4 GiB at once),
    equal to the whole at once."""
    from kiln.attention import lse_merge

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 50, 8, generator=g) for _ in range(3))
    whole = math_attention_with_lse(q, k, v, 0.3, causal)
    monkeypatch.setattr(lse_merge, "SCORE_BYTES", 4 * 3 * 50 * 7)  # 7 queries a block
    shapes, matmul = [], torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: shapes.append(a.shape) or matmul(a, b))
    blocked = math_attention_with_lse(q, k, v, 0.3, causal)
    assert max(s[1] for s in shapes) == 7
    for got, want in zip(blocked, whole):
        assert (got - want).abs().max() < TOL
