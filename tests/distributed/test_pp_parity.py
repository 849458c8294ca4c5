"""Pipeline parallelism, 2 stages on the mp executor: greedy tokens equal HF's, with the tied
head on the last stage loading the embedding's tensor (Qwen2) and an untied one (Llama)."""
import pytest

from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen2",
                                  # scaled embedding on the first stage, tied head on the last
                                  pytest.param("gemma", marks=pytest.mark.slow),
                                  # a layer passing (MLP branch, h) on, not (out, residual)
                                  pytest.param("olmo2", marks=pytest.mark.slow)])
def test_pp2_greedy_matches_hf(arch, request, ranks_exit):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = make_llm(model_dir, pipeline_parallel_size=2)
    assert generate_ids(llm) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    stats = llm.llm_engine.engine_core.executor.comm_stats()
    first, last = stats["ranks"]
    assert first["comm"]["pp_send"]["calls"] > 0 and last["comm"]["pp_recv"]["calls"] > 0
    ranks_exit(llm)


@pytest.mark.slow
def test_pp2_mode3_greedy_matches_hf(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, pipeline_parallel_size=2,
                   compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})
    assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    llm.llm_engine.engine_core.shutdown()
    # each stage compiled and cached its own layers (under its own key: the graphs differ)
    assert sorted(d.name for d in (tmp_path / "cc").glob("*/rank_*")) == ["rank_0_stage_0",
                                                                          "rank_1_stage_1"]


def test_pp2_hybrid_model_keeps_its_kv_cache_groups(tiny_gemma3_dir, ranks_exit):
    """Gemma-3's window and global layers on two stages: the groups are computed over every
    layer (as vLLM's over every worker's) and each stage allocates its own layers' share; the
    tokens are HF's (its eager attention, windowed; pp=1's equal them in
    tests/e2e/test_sliding_window.py), past the window of 8."""
    prompts = [PROMPTS[1] + list(range(20, 34))]
    llm = make_llm(tiny_gemma3_dir, pipeline_parallel_size=2, block_size=4,
                   max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.llm_engine.engine_core.core.scheduler.kv_cache_manager.group_windows == (None, 8)
    assert generate_ids(llm, prompts) == hf_greedy(tiny_gemma3_dir, prompts, MAX_TOKENS,
                                                   attn_implementation="eager")
    ranks_exit(llm)
