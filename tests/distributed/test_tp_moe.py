"""Tensor parallelism over a mixture of experts, 2 ranks on the mp executor: each expert's
intermediate dimension split per rank, the block's one all-reduce after the experts and the
shared expert: Qwen2-MoE's greedy tokens (a shared expert, a dense layer) equal HF's.
"""
from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


def test_tp2_qwen2_moe_greedy_matches_hf(tiny_qwen2_moe_dir, ranks_exit):
    llm = make_llm(tiny_qwen2_moe_dir, tensor_parallel_size=2)
    assert generate_ids(llm) == hf_greedy(tiny_qwen2_moe_dir, PROMPTS, MAX_TOKENS)
    ranks_exit(llm)
