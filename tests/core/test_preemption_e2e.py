"""A real tiny Llama under KV-cache pressure: preemption and recompute change no output token.

Greedy, seeded sampling and n > 1 seeded requests over prompts sharing prefixes, run once with
room to spare and again with a cache so small that requests are preempted, with a small budget
(chunked prefill), prefix caching on and off; afterwards every block is free again.
"""
import random

import pytest

from kiln import LLM, SamplingParams

# Compile and kernel counters, scheduler state: this process must run the core.
pytestmark = pytest.mark.usefixtures("inprocess_core")


def _workload():
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts, params = [], []
    for i in range(8):
        own = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
        prompts.append({"prompt_token_ids": shared[:rng.choice([0, 6, 13, 20])] + own})
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, n=2,
                                         max_tokens=10, ignore_eos=True))
    return prompts, params


def _generate(model_dir, **engine_kw):
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
              **engine_kw)
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    return llm, tokens


@pytest.fixture(scope="module")
def roomy_tokens(tiny_llama_dir):
    llm, tokens = _generate(tiny_llama_dir, max_num_seqs=16, max_num_batched_tokens=512,
                            block_size=16)
    assert llm.llm_engine.engine_core.make_stats().num_preemptions == 0
    return tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_identical_under_preemption(tiny_llama_dir, roomy_tokens, prefix_caching):
    # 16 blocks of 4 = 64 slots (one max_model_len=64 request, as vLLM requires): two of
    # these requests (up to 49 tokens, 13 blocks) do not fit together.
    llm, tokens = _generate(tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=8,
                            block_size=4, num_gpu_blocks_override=16,
                            enable_prefix_caching=prefix_caching)
    core = llm.llm_engine.engine_core.core  # the EngineCore (in this process)
    stats = core.make_stats()
    assert stats.num_preemptions > 0
    assert tokens == roomy_tokens
    pool = core.scheduler.kv_cache_manager.block_pool
    assert stats.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in pool.blocks)
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    assert llm.reset_prefix_cache() and pool.num_cached_blocks() == 0
