"""DeepSeek MLA's prefill / decode split (kiln/attention/mla_backend.py, mla_prefill.py), as
vLLM's: prefill requests attend in the expanded form (kv_b_proj over the latent rows), decode
requests in the absorbed one. The split by query length as a pure function; a step mixing a
prefill over cached context (expanded 4 context tokens at a time), a decode and a fresh prefill
(decode first, padding rows after) against HF's logits within 1e-4 in float32, each request
through the form its length picks. The chunk planning and the chunked result against the
unchunked one: tests/model/test_mla_context_chunks.py.
Through LLM (chunked prefill, prefix-cache hits) in float32 and bfloat16:
tests/model/test_deepseek_vs_hf.py.
"""
import pytest
import torch

from kiln.attention import mla_backend
from kiln.attention.mla_backend import split_decodes_and_prefills
from kiln.model.loader import get_model
from model._attn_helper import (
    BlockPool,
    PagedRequest,
    allocate_kv_caches,
    build_step,
    kiln_config_for,
    run_step,
)

TOL = 1e-4


@pytest.mark.parametrize("lens, threshold, want", [
    ([1, 1, 1], 1, ([0, 1, 2], [])),
    ([5, 1, 0, 3, 1], 1, ([1, 4], [0, 3])),  # any order; an empty query is neither
    ([5, 1, 0, 3, 4], 4, ([1, 3, 4], [0])),  # 1 + 3 speculative tokens: a verify step decodes
    ([7], 1, ([], [0])),
])
def test_split_decodes_and_prefills(lens, threshold, want):
    assert split_decodes_and_prefills(lens, threshold) == want


def test_split_threshold_below_one_is_refused():
    with pytest.raises(ValueError, match="decode_threshold must be >= 1, got 0"):
        split_decodes_and_prefills([1], 0)


def test_mixed_step_splits_by_form_and_matches_hf(tiny_deepseek_v3_dir, monkeypatch):
    """Step 1 prefills A's first 10 tokens and all 12 of B's; step 2 runs B's decode token, A's
    next 8 over its 10 cached (the expanded context read back from the latent cache, 4 tokens
    at a time) and C's 6 fresh, then 2 padding rows; step 3 decodes A and B together."""
    from transformers import AutoModelForCausalLM

    calls = []
    expanded, chunked = mla_backend.expanded_attention, mla_backend.chunked_context_attention

    def spy(q, rows, *args):
        calls.append((q.shape[0], rows.shape[0]))
        return expanded(q, rows, *args)

    def chunked_spy(queries, rows, chunks, *args):
        chunks = list(chunks)
        calls.append(([q.shape[0] for q in queries], [len(c) for _, c in chunks]))
        return chunked(queries, rows, chunks, *args)

    monkeypatch.setattr(mla_backend, "expanded_attention", spy)
    monkeypatch.setattr(mla_backend, "chunked_context_attention", chunked_spy)
    monkeypatch.setattr(mla_backend.LatentAttentionImpl, "workspace_tokens", 4)
    cfg = kiln_config_for(tiny_deepseek_v3_dir)
    model = get_model(cfg)
    num_layers = cfg.model_config.num_layers
    allocate_kv_caches(model, cfg, 32, 4)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (19, 14, 6)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]  # [S, V] each
    a, b, c = (PagedRequest(s) for s in seqs)
    pool = BlockPool(32, 4)
    steps = [([a, b], [10, 12], 0), ([b, a, c], [1, 8, 6], 2), ([a, b], [1, 1], 0)]
    # (queries, keys) of each fresh expanded call, per layer, and (queries, context rows per
    # chunk) of each chunked one; decodes never expand
    forms = [[(10, 10), (12, 12)], [(6, 6), ([8], [4, 4, 2])], []]
    for (reqs, lens, padding), form in zip(steps, forms):
        before = [r.num_computed for r in reqs]
        calls.clear()
        ids, pos, md = build_step(pool, reqs, lens, num_padding=padding)
        got = run_step(model, cfg, ids, pos, md)
        want = torch.cat([refs[seqs.index(r.token_ids)][p:p + n]
                          for r, p, n in zip(reqs, before, lens)])
        assert (got[:len(want)] - want).abs().max() < TOL
        assert calls == form * num_layers
