"""LLM.classify / LLM.score on tiny random *ForSequenceClassification checkpoints against HF
transformers' (softmax / sigmoid of its logits, float32 both sides, within ATOL): the checkpoint
picks the pooling runner's classify task by itself, --convert / --task choose as vLLM's, a
cross-encoder scores the tokenizer's pair encoding, an embedding model scores by cosine, and
the compiled graph (mode 3) classifies as eager does."""
import json
import shutil

import pytest
import torch

from kiln import ClassificationRequestOutput, PoolingParams, ScoringRequestOutput
from kiln.entrypoints.llm import LLM
from pooling.hf_pooled import hf_logits

from checkpoints import random_prompts

ENGINE = dict(max_model_len=64, max_num_seqs=4, kv_cache_memory=0.02, compilation_config=0)
ATOL = 1e-5  # float32 on both sides (the score head is float32); observed ~2e-7
LENGTHS = [3, 19, 40, 64]


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_classify_matches_hf_and_the_checkpoint_picks_the_runner(tiny_cls_qwen3_dir,
                                                                 inprocess_core):
    prompts = random_prompts(4, LENGTHS, seed=3)
    llm = LLM(model=str(tiny_cls_qwen3_dir), max_num_batched_tokens=16, **ENGINE)  # chunks
    try:
        assert llm.llm_engine.get_supported_tasks() == ("classify", "encode")
        outs = llm.classify(ids(prompts), use_tqdm=False)
        assert all(isinstance(o, ClassificationRequestOutput) for o in outs)
        refs = hf_logits(tiny_cls_qwen3_dir, prompts)
        for o, ref in zip(outs, refs):
            assert o.outputs.num_classes == 3
            torch.testing.assert_close(torch.tensor(o.outputs.probs), ref.softmax(-1),
                                       atol=ATOL, rtol=0)
        raw = llm.classify(ids(prompts[:2]), use_tqdm=False,
                           pooling_params=PoolingParams(use_activation=False))
        for o, ref in zip(raw, refs):
            torch.testing.assert_close(torch.tensor(o.outputs.probs), ref, atol=ATOL, rtol=0)
        old = llm.encode(ids(prompts[:1]), PoolingParams(softmax=False), use_tqdm=False)
        torch.testing.assert_close(old[0].outputs.data, refs[0], atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="score needs a cross-encoder .* 3 labels"):
            llm.score("w5", "w6", use_tqdm=False)
        with pytest.raises(ValueError, match="embed needs an embedding model"):
            llm.embed("w5", use_tqdm=False)
        with pytest.raises(ValueError, match="prompt 0: dimensions applies to embeddings"):
            llm.classify("w5", use_tqdm=False, pooling_params=PoolingParams(dimensions=2))
        with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, "
                                             "you requested 65 tokens in the input for "
                                             "classification"):
            llm.classify(ids([[5] * 65]), use_tqdm=False)
    finally:
        llm.shutdown()


def test_cross_encoder_scores_the_pair_encoding_as_hf(tiny_ce_llama_dir, inprocess_core):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ce_llama_dir)
    query, docs = "w5 w6 w7", ["w8 w9", "w10 w11 w12 w13", "w7"]

    def expected(pairs):
        return [torch.sigmoid(r).item() for r in hf_logits(
            tiny_ce_llama_dir, [tok(a, text_pair=b)["input_ids"] for a, b in pairs])]

    llm = LLM(model=str(tiny_ce_llama_dir), task="score", **ENGINE)
    try:
        assert llm.llm_engine.get_supported_tasks() == ("classify", "score", "encode")
        one_to_n = llm.score(query, docs, use_tqdm=False)  # 1:N
        assert all(isinstance(o, ScoringRequestOutput) for o in one_to_n)
        for o, want in zip(one_to_n, expected([(query, d) for d in docs])):
            assert abs(o.outputs.score - want) < ATOL
        n_to_n = llm.score(docs, docs[::-1], use_tqdm=False)
        for o, want in zip(n_to_n, expected(list(zip(docs, docs[::-1])))):
            assert abs(o.outputs.score - want) < ATOL
        assert n_to_n[0].prompt_token_ids == tok(docs[0], text_pair=docs[2])["input_ids"]
        # cut in the tokenizer, longest first (vLLM passes truncation to it)
        cut = llm.score(query, docs[1], truncate_prompt_tokens=4, use_tqdm=False)[0]
        assert cut.prompt_token_ids == tok(query, text_pair=docs[1], truncation=True,
                                           max_length=4)["input_ids"]
        logit = llm.score(query, docs[0], use_tqdm=False,
                          pooling_params=PoolingParams(use_activation=False))[0]
        assert abs(torch.sigmoid(torch.tensor(logit.outputs.score)).item()
                   - one_to_n[0].outputs.score) < ATOL
        with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3: input lengths "
                                             "must be either 1:1, 1:N or N:N"):
            llm.score(docs[:2], docs, use_tqdm=False)
        with pytest.raises(ValueError, match="data_2 is empty"):
            llm.score(query, [], use_tqdm=False)
        # the checkpoint picked the pooling runner, and no flag gives it an LM head
        with pytest.raises(ValueError, match=r"pooling runner: use classify\(\), score\(\), "
                                             r"encode\(\); or LlamaForSequenceClassification "
                                             "is a classification model"):
            llm.generate("w5")
    finally:
        llm.shutdown()


def test_an_embedding_model_scores_by_cosine(tiny_qwen3_dir, inprocess_core):
    llm = LLM(model=str(tiny_qwen3_dir), runner="pooling", **ENGINE)
    try:
        texts = ids(random_prompts(3, [4, 9, 13], seed=2))
        vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
        scores = llm.score(texts[0], texts[1:], use_tqdm=False)
        for s, v in zip(scores, vectors[1:]):
            assert abs(s.outputs.score - float(vectors[0] @ v)) < 1e-5
        # vLLM's tokens of an embedding pair: both prompts (no pad token here)
        assert scores[0].prompt_token_ids == texts[0]["prompt_token_ids"] + \
            texts[1]["prompt_token_ids"]
        with pytest.raises(ValueError, match="classify needs a classification model"):
            llm.classify("w5", use_tqdm=False)
    finally:
        llm.shutdown()


def test_convert_and_task_choose_as_vllms(tiny_cls_qwen3_dir, tiny_qwen3_dir, tmp_path,
                                          inprocess_core):
    """--convert classify reads a *ForCausalLM checkpoint's score head; --task embed embeds
    with a classifier's backbone; a classifier cannot generate."""
    causal = tmp_path / "causal"
    shutil.copytree(tiny_cls_qwen3_dir, causal)
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**config,
                                                    "architectures": ["Qwen3ForCausalLM"]}))
    prompt = random_prompts(1, [7], seed=4)
    llm = LLM(model=str(causal), runner="pooling", convert="classify", **ENGINE)
    try:
        got = llm.classify(ids(prompt), use_tqdm=False)[0].outputs.probs
        torch.testing.assert_close(torch.tensor(got),
                                   hf_logits(tiny_cls_qwen3_dir, prompt)[0].softmax(-1),
                                   atol=ATOL, rtol=0)
    finally:
        llm.shutdown()
    embed = LLM(model=str(tiny_cls_qwen3_dir), task="embed", **ENGINE)
    try:
        assert embed.llm_engine.get_supported_tasks() == ("embed", "encode")
        assert len(embed.embed(ids(prompt), use_tqdm=False)[0].outputs.embedding) == 64
    finally:
        embed.shutdown()
    with pytest.raises(ValueError, match="is a classification model .* drop --runner generate"):
        LLM(model=str(tiny_cls_qwen3_dir), runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="checkpoint has no score.weight"):
        LLM(model=str(tiny_qwen3_dir), task="classify", **ENGINE)
    with pytest.raises(ValueError, match="--convert embed and --task classify disagree"):
        LLM(model=str(tiny_qwen3_dir), convert="embed", task="classify", **ENGINE)


def test_compiled_mode_3_classifies_as_eager(tiny_cls_qwen3_dir, inprocess_core, tmp_path):
    prompts = random_prompts(3, [5, 30, 12], seed=9)
    probs = []
    compiled = {"mode": 3, "backend": "eager", "cache_dir": str(tmp_path / "cc")}
    for mode in (0, compiled):
        llm = LLM(model=str(tiny_cls_qwen3_dir), max_num_batched_tokens=16,
                  **{**ENGINE, "compilation_config": mode})
        try:
            probs.append([o.outputs.probs for o in llm.classify(ids(prompts), use_tqdm=False)])
        finally:
            llm.shutdown()
    torch.testing.assert_close(torch.tensor(probs[1]), torch.tensor(probs[0]), atol=1e-6,
                               rtol=0)
