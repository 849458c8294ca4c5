"""LLM(runner="pooling").embed / encode on tiny random checkpoints against HF transformers'
AutoModel (last_hidden_state, after the final norm) pooled the same way: LAST, MEAN and CLS,
normalized or not, batched prompts of different lengths, prompts prefilled in chunks, and
the compiled graph (mode 3) against eager."""
import pytest
import torch

from kiln import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams
from pooling.hf_pooled import hf_pooled

from checkpoints import random_prompts

ENGINE = dict(max_model_len=64, max_num_seqs=4, kv_cache_memory=0.02)
LENGTHS = [3, 19, 40, 64]  # one fills max_model_len: nothing is generated after it
ATOL = 2e-5  # float32 on both sides; observed ~2e-7


def embed(llm, prompts, **kwargs) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kwargs)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("arch, pooler, chunk", [
    ("qwen3", None, None),  # vLLM's defaults for a decoder: LAST, normalized
    ("llama", {"pooling_type": "MEAN", "normalize": True}, 16),  # MEAN across chunks
    ("qwen3", {"pooling_type": "CLS", "normalize": False}, 16),
])
def test_embed_matches_hf(request, inprocess_core, arch, pooler, chunk):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=3)
    llm = LLM(model=str(model_dir), runner="pooling", compilation_config=0,
              pooler_config=pooler, max_num_batched_tokens=chunk, **ENGINE)
    try:
        got = embed(llm, prompts)
        kind = (pooler or {}).get("pooling_type", "LAST")
        normalize = (pooler or {}).get("normalize", True)
        for g, ref in zip(got, hf_pooled(model_dir, prompts, kind, normalize)):
            torch.testing.assert_close(g, ref, atol=ATOL, rtol=0)
        # the request's normalize wins over the engine's
        raw = embed(llm, prompts[:2], pooling_params=PoolingParams(normalize=False))
        for g, ref in zip(raw, hf_pooled(model_dir, prompts[:2], kind, False)):
            torch.testing.assert_close(g, ref, atol=ATOL, rtol=0)
        stats = llm.llm_engine.get_stats()  # every request finished, its blocks freed
        assert stats["num_running"] == stats["num_waiting"] == 0
        # pooled prompts count, as vLLM's (they ended with no token)
        assert stats["prompt_tokens_total"] == sum(LENGTHS) + 3 + 19
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        llm.shutdown()


def test_chunked_mean_equals_unchunked_and_encode(tiny_llama_dir, inprocess_core):
    prompts = random_prompts(4, [33, 7, 50, 18], seed=5)
    vectors = []
    for chunk in (None, 8):
        llm = LLM(model=str(tiny_llama_dir), task="embed", compilation_config=0,
                  pooler_config='{"pooling_type": "MEAN"}', max_num_batched_tokens=chunk,
                  **ENGINE)
        try:
            vectors.append(embed(llm, prompts))
            if chunk is None:
                encoded = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
                assert all(isinstance(o, PoolingRequestOutput) for o in encoded)
                for o, v in zip(encoded, vectors[0]):
                    assert torch.equal(o.outputs.data, v)
        finally:
            llm.shutdown()
    for a, b in zip(*vectors):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_errors_name_the_field(tiny_qwen3_dir, tiny_llama_dir, inprocess_core):
    with pytest.raises(ValueError, match="pooling_type 'MAX' is not supported"):
        LLM(model=str(tiny_qwen3_dir), runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="--task 'reward' is not supported"):
        LLM(model=str(tiny_qwen3_dir), task="reward")
    with pytest.raises(ValueError, match="--pooler-config configures the pooling runner"):
        LLM(model=str(tiny_qwen3_dir), pooler_config={"pooling_type": "MEAN"})
    llm = LLM(model=str(tiny_qwen3_dir), runner="pooling", compilation_config=0, **ENGINE)
    try:
        with pytest.raises(ValueError, match=r"prompt 1: dimensions: .* does not support "
                                             "matryoshka"):
            llm.embed(["a", {"prompt_token_ids": [5, 6]}], use_tqdm=False,
                      pooling_params=[None, PoolingParams(dimensions=8)])
        with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, "
                                             "you requested 65 tokens"):
            llm.embed({"prompt_token_ids": [5] * 65}, use_tqdm=False)
        cut = llm.embed({"prompt_token_ids": list(range(3, 3 + 70))}, use_tqdm=False,
                        truncate_prompt_tokens=10)
        assert cut[0].prompt_token_ids == list(range(63, 73))  # the last 10, as vLLM keeps
        with pytest.raises(ValueError, match=r"LLM\.generate\(\) is only supported for "
                                             "generative models"):
            llm.generate("hi", SamplingParams(max_tokens=2))
        assert llm.llm_engine.get_supported_tasks() == ("embed", "encode")
    finally:
        llm.shutdown()
    gen = LLM(model=str(tiny_llama_dir), compilation_config=0, **ENGINE)
    try:
        with pytest.raises(ValueError, match="start it with --runner pooling"):
            gen.embed(["hi"], use_tqdm=False)
    finally:
        gen.shutdown()


def test_compiled_mode_3_equals_eager(tiny_qwen3_dir, inprocess_core, tmp_path):
    """Mode 3's piecewise graph (split at attention; the eager backend keeps the test fast:
    Inductor's code computes the same graph) returns the final-norm hidden states too."""
    prompts = random_prompts(3, [5, 30, 12], seed=9)
    vectors = []
    compiled = {"mode": 3, "backend": "eager", "cache_dir": str(tmp_path / "cc")}
    for mode in (0, compiled):
        llm = LLM(model=str(tiny_qwen3_dir), runner="pooling", compilation_config=mode,
                  pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=16, **ENGINE)
        try:
            vectors.append(embed(llm, prompts))
        finally:
            llm.shutdown()
    for a, b in zip(*vectors):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_sentence_transformers_checkpoint_runs_the_pooling_runner_by_default(
        tiny_llama_dir, tmp_path, inprocess_core):
    """vLLM's auto runner of a sentence-transformers checkpoint whose architecture is
    *ForCausalLM (Qwen3-Embedding's) is pooling: no --runner needed. Kiln ran the generate
    runner, so LLM(model).embed and /v1/embeddings refused; an explicit runner still wins."""
    import json
    import shutil

    model_dir = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True}))
    prompts = random_prompts(2, [5, 23], seed=8)
    llm = LLM(model=str(model_dir), compilation_config=0, **ENGINE)
    try:
        assert llm.llm_engine.get_supported_tasks() == ("embed", "encode")
        for g, ref in zip(embed(llm, prompts), hf_pooled(model_dir, prompts, "MEAN", True)):
            torch.testing.assert_close(g, ref, atol=ATOL, rtol=0)
    finally:
        llm.shutdown()
    llm = LLM(model=str(model_dir), runner="generate", compilation_config=0, **ENGINE)
    try:
        assert llm.llm_engine.get_supported_tasks() == ("generate",)
    finally:
        llm.shutdown()


def test_truncating_a_text_prompt_keeps_its_bos(inprocess_core):
    """truncate_prompt_tokens on a text prompt keeps the tokenizer's BOS and the last tokens
    after it, as HF's left truncation (vLLM's tokenizing) and Kiln's generate path: the
    pooling path cut [BOS] off with the rest. Token ids are cut as given."""
    from checkpoints import STORIES_DIR

    llm = LLM(model=str(STORIES_DIR), runner="pooling", compilation_config=0, **ENGINE)
    try:
        text = "once upon a time there was a little cat who sat on the mat"
        full = llm.embed(text, use_tqdm=False)[0].prompt_token_ids
        assert full[0] == 1 and len(full) > 6  # the Llama tokenizer's <s>
        cut = llm.embed(text, truncate_prompt_tokens=4, use_tqdm=False)[0].prompt_token_ids
        assert cut == [1] + full[-3:]
        ids = llm.embed({"prompt_token_ids": full}, truncate_prompt_tokens=4,
                        use_tqdm=False)[0].prompt_token_ids
        assert ids == full[-4:]
    finally:
        llm.shutdown()
