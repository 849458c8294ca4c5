"""A Mistral with a window of 8 in every layer generating far past it on a KV cache of 16 blocks
of 4 (64 slots, fewer than one max_model_len=128 request's tokens): blocks behind the window go
back to the pool, so the engine starts, three requests of up to 76 tokens run side by side
without preemption, each holding a bounded number of blocks, a prompt longer than the whole cache
is taken, and the tokens equal HF's."""
import pytest

from kiln import LLM, SamplingParams
from kiln.core.sliding_window_blocks import peak_blocks

from checkpoints import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("inprocess_core")  # the scheduler is read in this process

NEW_TOKENS = 40
BUDGET = 16
FIRST = random_prompts(2, [20, 33], seed=7)
PROMPTS = FIRST + [FIRST[0] + [5, 6, 7]]  # the last one hits the first one's blocks
# longer than the whole cache (64 slots): its window's blocks fit all the same
LONG = random_prompts(1, [80], seed=8)


@pytest.fixture(scope="module")
def hf_tokens(tiny_mistral_window_dir):
    return hf_greedy(tiny_mistral_window_dir, PROMPTS + LONG, NEW_TOKENS,
                     attn_implementation="eager")


@pytest.mark.parametrize("prefix_caching, backend", [(True, "cpu"), (False, "torch")])
def test_windowed_generation_holds_bounded_blocks(tiny_mistral_window_dir, hf_tokens,
                                                  monkeypatch, prefix_caching, backend):
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", backend)
    llm = LLM(model=str(tiny_mistral_window_dir), dtype="float32", enforce_eager=True,
              block_size=4, num_gpu_blocks_override=16, max_model_len=128,
              max_num_batched_tokens=BUDGET, max_num_seqs=4,
              enable_prefix_caching=prefix_caching)
    assert llm.llm_engine.max_model_len == 128  # not capped at the cache's 64 slots
    scheduler = llm.llm_engine.engine_core.core.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.sliding_window == 8
    held: list[int] = []  # every request's real blocks, after each schedule
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        held.extend(sum(b is not None for b in blocks) for blocks in kv.req_to_blocks.values())
        return out

    scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens[:3]
    # a prefill chunk's window and blocks, at most (a decode: 3), never a whole request's
    assert max(held) <= peak_blocks(128, BUDGET, 0, 8, 4) == 7
    stats = scheduler.make_stats()
    assert stats.num_preemptions == 0
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    assert kv.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    if prefix_caching:  # once is enough
        (out,) = llm.generate([{"prompt_token_ids": LONG[0]}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_tokens[3]
        assert kv.num_free_blocks == 16
