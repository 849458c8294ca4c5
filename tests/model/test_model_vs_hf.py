"""Kiln's Llama / Qwen2 / Qwen3 / Phi-3 / Granite / Gemma / OLMo-2 / StarCoder2 / GPT-NeoX / Phi /
Cohere against HF transformers on tiny random checkpoints (float32).

Covers one-shot prefill, decode through the paged cache, chunked prefill and a mixed batch.
"""
import pytest
import torch

from kiln.model.layers.attention import attention_layers
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
NUM_BLOCKS, BLOCK_SIZE = 64, 4


# Module scope: one Kiln model and one HF model per family serve its five tests (a test's
# requests write each block of the shared cache before they read it).
@pytest.fixture(scope="module", params=[
    "llama", "qwen2", "qwen3", "phi3", "granite", "gemma", "olmo2", "starcoder2", "gpt_neox",
    # their e2e parity and config variants run in `make test`
    pytest.param("phi", marks=pytest.mark.slow), pytest.param("cohere", marks=pytest.mark.slow)])
def ckpt_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def models(ckpt_dir):
    from transformers import AutoModelForCausalLM

    cfg = kiln_config_for(ckpt_dir)
    model = get_model(cfg)
    allocate_kv_caches(model, cfg, NUM_BLOCKS, BLOCK_SIZE)
    hf = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    return cfg, model, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [S, V]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_then_decode_matches_hf(models):
    cfg, model, hf = models
    seq = tokens(26, seed=1)
    ref = hf_logits(hf, seq)
    pool, req = BlockPool(NUM_BLOCKS, BLOCK_SIZE), PagedRequest(seq)
    ids, pos, md = build_step(pool, [req], [20])
    out = run_step(model, cfg, ids, pos, md)
    assert out.dtype == torch.float32 and out.shape == (20, 512)
    assert (out - ref[:20]).abs().max() < TOL
    for p in range(20, 26):  # decode steps read everything back from the paged cache
        ids, pos, md = build_step(pool, [req], [1])
        assert md.uniform_decode
        out = run_step(model, cfg, ids, pos, md)
        assert (out[0] - ref[p]).abs().max() < TOL


def test_chunked_prefill_matches_hf(models):
    cfg, model, hf = models
    seq = tokens(21, seed=2)
    ref = hf_logits(hf, seq)
    pool, req = BlockPool(NUM_BLOCKS, BLOCK_SIZE), PagedRequest(seq)
    got = []
    for chunk in (9, 12):  # the second chunk attends to the first through the cache
        ids, pos, md = build_step(pool, [req], [chunk])
        got.append(run_step(model, cfg, ids, pos, md))
    assert (torch.cat(got) - ref).abs().max() < TOL


def test_mixed_batch_matches_per_request(models):
    cfg, model, hf = models
    a, b, c = tokens(17, seed=3), tokens(11, seed=4), tokens(10, seed=5)
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    req_c = PagedRequest(c)
    ids, pos, md = build_step(pool, [req_c], [9])  # c's context goes into the cache first
    run_step(model, cfg, ids, pos, md)
    req_a, req_b = PagedRequest(a), PagedRequest(b)
    # Two prefills and one decode in one step, plus 3 padding tokens (slot -1).
    ids, pos, md = build_step(pool, [req_a, req_b, req_c], [17, 11, 1], num_padding=3)
    out = run_step(model, cfg, ids, pos, md)
    assert out.shape[0] == 17 + 11 + 1 + 3
    assert (out[:17] - hf_logits(hf, a)).abs().max() < TOL
    assert (out[17:28] - hf_logits(hf, b)).abs().max() < TOL
    assert (out[28] - hf_logits(hf, c)[9]).abs().max() < TOL


def test_batched_decode_matches_hf(models):
    cfg, model, hf = models
    seqs = [tokens(n, seed=10 + n) for n in (5, 13, 8)]
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    reqs = [PagedRequest(s) for s in seqs]
    ids, pos, md = build_step(pool, reqs, [len(s) - 1 for s in seqs])
    run_step(model, cfg, ids, pos, md)
    ids, pos, md = build_step(pool, reqs, [1, 1, 1])  # the padded one-SDPA decode path
    out = run_step(model, cfg, ids, pos, md)
    for i, s in enumerate(seqs):
        assert (out[i] - hf_logits(hf, s)[-1]).abs().max() < TOL


def test_warmup_without_metadata_is_causal_and_leaves_cache(models):
    cfg, model, hf = models
    seq = tokens(12, seed=6)
    layer = next(iter(attention_layers(model).values()))
    before = layer.kv_cache.clone()
    out = run_step(model, cfg, torch.tensor(seq), torch.arange(12), None)
    assert (out - hf_logits(hf, seq)).abs().max() < TOL
    assert torch.equal(layer.kv_cache, before)
