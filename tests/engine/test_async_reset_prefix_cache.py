"""vLLM's `await AsyncLLM.reset_prefix_cache(reset_running_requests=..., reset_connector=...)`
(an RL trainer's call after pushing new weights): AsyncLLM had no such method. Mid-stream, the
running requests go back to the queue, are recomputed, and their streams end as without it."""
import asyncio

import pytest

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=64,
        block_size=4, num_gpu_blocks_override=32, max_num_seqs=4,
        scheduling_policy="priority"))
    yield engine
    engine.shutdown()


async def _generate(engine, tag: str, reset: bool) -> list[list[int]]:
    async def one(i):
        tokens = []
        async for out in engine.generate(PROMPTS[i], GREEDY, f"{tag}{i}", priority=i):
            tokens = list(out.outputs[0].token_ids)
            if reset and i == 0 and len(tokens) == 3:
                assert not await engine.reset_prefix_cache()  # blocks held: refused
                assert await engine.reset_prefix_cache(reset_running_requests=True,
                                                       reset_connector=False)
        return tokens
    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 120)


def test_async_reset_prefix_cache_requeues_running_requests(engine):
    want = asyncio.run(_generate(engine, "plain", reset=False))
    assert all(len(t) == GREEDY.max_tokens for t in want)
    assert asyncio.run(_generate(engine, "reset", reset=True)) == want
    stats = engine.engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert asyncio.run(engine.reset_prefix_cache())  # idle: nothing holds a block
