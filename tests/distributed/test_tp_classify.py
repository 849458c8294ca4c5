"""Tensor parallelism (2 ranks, mp executor) on a classifier: the score head is replicated on
every rank over the all-reduced final state, so probabilities match HF's as at TP=1."""
import torch
from pooling.hf_pooled import hf_logits

from checkpoints import random_prompts
from parallel_helpers import make_llm


def test_tp2_classify_matches_hf(tiny_cls_qwen3_dir, ranks_exit):
    prompts = random_prompts(3, [4, 21, 40], seed=6)
    llm = make_llm(tiny_cls_qwen3_dir, tensor_parallel_size=2, max_model_len=64)
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for o, ref in zip(outs, hf_logits(tiny_cls_qwen3_dir, prompts)):
        torch.testing.assert_close(torch.tensor(o.outputs.probs), ref.softmax(-1), atol=1e-5,
                                   rtol=0)
    ranks_exit(llm)
