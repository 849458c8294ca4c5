"""AsyncLLM used directly from more than one event loop, one after another (a script's second
asyncio.run, a notebook's new loop): the engine carries on, and a loop's abandoned requests are
aborted, not left running."""
import asyncio
import gc
import threading

import pytest

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.sampling_params import RequestOutputKind, SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_llama_dir), enforce_eager=True, max_model_len=128, max_num_seqs=4,
        kv_cache_memory=0.02))
    yield engine
    engine.shutdown()


async def tokens(engine, request_id):
    async def run():
        outs = [o async for o in engine.generate(PROMPT, GREEDY, request_id)]
        return outs[-1].outputs[0].token_ids
    return await asyncio.wait_for(run(), 60)


def test_later_event_loops_keep_the_engine_running(engine):
    """The step loop's wake event was bound to the first loop: the next loop's first idle wait
    raised, and the engine failed every request after ("restart the server")."""
    first = asyncio.run(tokens(engine, "a"))
    assert len(first) == 6
    for i in range(3):
        assert asyncio.run(tokens(engine, f"b{i}")) == first

    async def leave_one_running():
        stream = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100,
                                                        ignore_eos=True), "left")
        await stream.__anext__()
        return stream  # its loop closes under it

    asyncio.run(leave_one_running())
    assert asyncio.run(tokens(engine, "c")) == first
    assert engine.is_running and engine.num_in_flight == 0
    stats = engine.engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_second_loop_while_the_first_runs_is_refused(engine):
    started, stop = threading.Event(), None

    def other_thread():
        nonlocal stop
        async def hold():
            nonlocal stop
            stop = asyncio.Event()
            await tokens(engine, "other")
            started.set()
            await stop.wait()
        asyncio.run(hold())

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert started.wait(60)
    try:
        with pytest.raises(RuntimeError, match="event loop running in another thread"):
            asyncio.run(tokens(engine, "here"))
    finally:
        engine._loop.call_soon_threadsafe(stop.set)
        thread.join(60)
    assert asyncio.run(tokens(engine, "after")) == asyncio.run(tokens(engine, "again"))
    assert engine.is_running


def test_a_closed_loops_step_task_collected_later_leaves_the_engine_running(engine):
    """A loop closed without cancelling its tasks (run_until_complete, then close) left the
    idle step task pending; collected after a later loop took over, its GeneratorExit was
    taken for a failed step: every later request got "restart the server"."""
    loop = asyncio.new_event_loop()
    first = loop.run_until_complete(tokens(engine, "own-loop"))
    loop.close()
    assert asyncio.run(tokens(engine, "next")) == first  # takes over from the closed loop
    gc.collect()
    assert asyncio.run(tokens(engine, "after-collect")) == first
    assert engine.is_running


# the test's own consumer task, destroyed with its closed loop, cannot cancel its queue wait
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_new_loop_aborts_a_request_whose_loop_was_closed_under_its_consumer(engine):
    """abort() from a new loop ended the old stream first, waking a waiter of the closed loop:
    RuntimeError('Event loop is closed'), and the request (already forgotten) ran on."""
    loop = asyncio.new_event_loop()

    async def leave_a_consumer_waiting():
        stream = await engine.add_request("orphan", PROMPT, SamplingParams(
            n=2, temperature=0, max_tokens=100, ignore_eos=True))
        first = loop.create_future()

        async def consume():
            async for _ in stream:
                if not first.done():
                    first.set_result(None)
        loop.create_task(consume())
        await first

    loop.run_until_complete(leave_a_consumer_waiting())
    loop.close()
    asyncio.run(engine.abort("orphan"))
    stats = engine.engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert engine.num_in_flight == 0
    assert asyncio.run(tokens(engine, "then")) == asyncio.run(tokens(engine, "again"))
    # The consumer's coroutine sits in a cycle with its stream: collected here, its "Event loop
    # is closed" is this test's (ignored above), not a warning in a later test's summary.
    gc.collect()
