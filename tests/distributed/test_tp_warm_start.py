"""Compilation per rank under TP=2 (mode 3): each rank compiles its own graph into its own
`rank_<r>` directory under the cache key, greedy tokens equal HF's, serving compiles nothing,
and a second engine on the same cache compiles nothing in either rank. On Qwen3: Llama's graph
plus per-head q / k norms over each rank's heads."""
from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


def _rank_compiles(llm) -> list[int]:
    return [r["compilation"]["num_inductor_compiles"]
            for r in llm.llm_engine.engine_core.executor.comm_stats()["ranks"]]


def test_tp2_compiles_per_rank_and_warm_starts_without_compiling(tiny_qwen3_dir, tmp_path):
    cache = tmp_path / "cc"
    config = {"mode": 3, "cache_dir": str(cache)}
    cold = make_llm(tiny_qwen3_dir, tensor_parallel_size=2, compilation_config=config)
    compiled = _rank_compiles(cold)
    assert all(n > 0 for n in compiled)
    assert generate_ids(cold) == hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_TOKENS)
    assert _rank_compiles(cold) == compiled  # serving compiled nothing, in any rank
    cold.llm_engine.engine_core.shutdown()
    keys = [d for d in cache.iterdir() if (d / "rank_0").is_dir()]
    assert len(keys) == 1 and (keys[0] / "rank_1").is_dir()

    warm = make_llm(tiny_qwen3_dir, tensor_parallel_size=2, compilation_config=config)
    assert _rank_compiles(warm) == [0, 0]
    assert generate_ids(warm) == hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_TOKENS)
    assert _rank_compiles(warm) == [0, 0]
    warm.llm_engine.engine_core.shutdown()
