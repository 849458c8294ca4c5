"""Tensor parallelism over DeepSeek-V3, 2 ranks on the mp executor: latent attention's heads split
(q_b_proj and kv_b_proj by columns, o_proj by rows; the latent projection replicated, so each
rank's latent cache holds the whole latent, as vLLM's), each expert's intermediate dimension and
the shared experts split, one all-reduce per MoE block: greedy tokens equal HF's (as tp=1's).
"""
from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


def test_tp2_deepseek_v3_greedy_matches_hf(tiny_deepseek_v3_dir, ranks_exit):
    llm = make_llm(tiny_deepseek_v3_dir, tensor_parallel_size=2)
    assert generate_ids(llm) == hf_greedy(tiny_deepseek_v3_dir, PROMPTS, MAX_TOKENS)
    ranks_exit(llm)
