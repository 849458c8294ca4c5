"""AsyncLLM against a fake engine: concurrency, output kinds, abort, cancellation, failures."""
import asyncio
import time

import pytest

from kiln.engine.async_llm import AsyncLLM, EngineDeadError
from kiln.engine.output_merge import DeltaAccumulator
from kiln.entrypoints.openai.serving_engine import add_request_error
from kiln.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

from .fake_engine import FakeEngine


def run(coro):
    return asyncio.run(coro)


def params(kind=RequestOutputKind.DELTA, **kw):
    return SamplingParams(temperature=0, output_kind=kind, **kw)


def test_merge_delta_accumulates_text_tokens_and_logprobs():
    a = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "he", [5], -1.0, [{5: None}])],
                      metrics=RequestMetrics(first_scheduled_time=12.5))
    b = RequestOutput("r", None, [], [CompletionOutput(0, "llo", [6, 7], -3.0, [{6: None},
                                                                               {7: None}],
                                                       finish_reason="stop", stop_reason=2)],
                      finished=True)
    acc = DeltaAccumulator()
    acc.add(a)
    first = acc.snapshot()
    acc.add(b)
    m = acc.snapshot()
    assert first.outputs[0].token_ids == [5] and first.outputs[0].text == "he"  # a snapshot stays
    (o,) = m.outputs
    assert (o.text, o.token_ids, o.cumulative_logprob, len(o.logprobs)) == ("hello", [5, 6, 7],
                                                                            -3.0, 3)
    assert (o.finish_reason, o.stop_reason, m.finished, m.prompt, m.prompt_token_ids) == (
        "stop", 2, True, "p", [1, 2])
    assert a.outputs[0].text == "he"  # inputs untouched
    assert m.metrics == RequestMetrics(first_scheduled_time=12.5)  # later deltas carry none


def test_output_kinds_and_many_concurrent_requests():
    async def main():
        llm = AsyncLLM(FakeEngine())
        delta_ids, cumulative, finals = [], [], []

        async def consume(i):
            async for out in llm.generate(f"prompt {i}", params(max_tokens=5), f"d{i}"):
                delta_ids.append((i, out.outputs[0].token_ids))

        async def consume_cumulative():
            async for out in llm.generate("abc", params(RequestOutputKind.CUMULATIVE,
                                                        max_tokens=4), "c"):
                cumulative.append(list(out.outputs[0].token_ids))

        async def consume_final():
            async for out in llm.generate("abc", params(RequestOutputKind.FINAL_ONLY,
                                                        max_tokens=4), "f"):
                finals.append(out)

        await asyncio.gather(*(consume(i) for i in range(16)), consume_cumulative(),
                             consume_final())
        llm.shutdown()
        return delta_ids, cumulative, finals

    delta_ids, cumulative, finals = run(main())
    for i in range(16):
        mine = [ids for j, ids in delta_ids if j == i]
        assert len(mine) == 5 and all(len(ids) == 1 for ids in mine)
    assert [len(c) for c in cumulative] == [1, 2, 3, 4]
    assert cumulative[-1][:3] == cumulative[2]
    assert len(finals) == 1 and finals[0].finished
    assert finals[0].outputs[0].token_ids == cumulative[-1]  # same prompt, same tokens


def test_add_request_error_surfaces_and_others_continue():
    async def main():
        engine = FakeEngine(max_model_len=16)
        llm = AsyncLLM(engine)
        good = asyncio.create_task(_collect(llm.generate("ok", params(max_tokens=6), "good")))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(llm.generate("x" * 40, params(), "bad"))
        with pytest.raises(ValueError, match="already in flight") as dup:
            await llm.add_request("good", "ok", params())
        # The server's 400 names the field at fault, not the prompt.
        assert add_request_error(dup.value, "prompt").param == "request_id"
        # A lone surrogate failed on its way to the core process, labelled the prompt's
        with pytest.raises(ValueError, match="surrogate") as odd:
            await llm.add_request("a\ud800", "ok", params())
        assert add_request_error(odd.value, "prompt").param == "request_id"
        outs = await good
        llm.shutdown()
        return outs

    outs = run(main())
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6 and outs[-1].finished


async def _collect(agen):
    return [o async for o in agen]


def test_cancelling_the_consumer_aborts_the_request():
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        seen = []

        async def consume():
            async for out in llm.generate("long", params(max_tokens=1000), "victim"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await llm.get_stats()  # runs after the queued abort, on the engine thread
        llm.shutdown()
        return engine, stats

    engine, stats = run(main())
    assert engine.aborted == ["victim"]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_abort_ends_stream_and_frees_at_once():
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        stream = await llm.add_request("a", "x", params(max_tokens=1000))
        await stream.__anext__()
        await llm.abort("a")
        running = engine.has_unfinished_requests()
        llm.shutdown()
        return running, engine

    running, engine = run(main())
    assert not running and engine.aborted == ["a"]


def test_engine_failure_fails_in_flight_requests_and_later_ones():
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        stream = await llm.add_request("a", "x", params(max_tokens=1000))
        await stream.__anext__()
        engine.fail_next_step = True
        with pytest.raises(EngineDeadError, match="injected"):
            async for _ in stream:
                pass
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.add_request("b", "x", params())
        llm.shutdown()

    run(main())


def test_shutdown_aborts_in_flight_and_stops_engine():
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        stream = await llm.add_request("a", "x", params(max_tokens=1000))
        await stream.__anext__()
        llm.shutdown()
        rest = [out async for out in stream]  # ended as vLLM's shutdown ends it, not an error
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        return engine

    engine = run(main())
    assert engine.aborted == ["a"] and engine.shut_down


def test_shutdown_drain_lets_short_requests_finish():
    async def main():
        engine = FakeEngine(step_delay=0.005)
        llm = AsyncLLM(engine)
        task = asyncio.create_task(_collect(llm.generate("x", params(max_tokens=5), "a")))
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        await llm.drain_and_shutdown(drain_timeout=5.0)
        return await task, engine

    outs, engine = run(main())
    assert outs[-1].finished and engine.aborted == []


def test_an_id_used_again_at_once_gets_none_of_its_namesakes_outputs():
    """A caller that leaves a stream (aborting it) and adds the same id at once: the step then
    running still made an output of the old request, which reached the new stream (its tokens
    began with the old request's; a final one ended it with the old request's text)."""
    async def main():
        llm = AsyncLLM(FakeEngine(step_delay=0.05))
        want = [o.outputs[0].token_ids async for o in llm.generate(
            {"prompt_token_ids": [9, 8]}, params(max_tokens=4), "ref")]
        for _ in range(3):
            old = llm.generate({"prompt_token_ids": [5, 6, 7]}, params(max_tokens=50), "x")
            async for _ in old:
                break  # a step of x is running now
            await old.aclose()
            got = [o.outputs[0].token_ids async for o in llm.generate(
                {"prompt_token_ids": [9, 8]}, params(max_tokens=4), "x")]
            assert got == want
        llm.shutdown()

    run(main())


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_an_abort_by_another_caller_ends_the_consumers_stream(kind):
    """llm.abort(id) from elsewhere left the task iterating generate() waiting for good; vLLM
    ends the stream with a final output, finish_reason "abort"."""
    async def main():
        llm = AsyncLLM(FakeEngine(step_delay=0.01))
        seen = []

        async def consume():
            async for out in llm.generate({"prompt_token_ids": [5, 6]},
                                          params(kind, max_tokens=1000, n=2), "a"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 2:
            await asyncio.sleep(0.005)
        await llm.abort("a")
        await asyncio.wait_for(task, 5)
        llm.shutdown()
        return seen

    seen = run(main())
    last = seen[-1]
    assert last.finished and [o.finish_reason for o in last.outputs] == ["abort", "abort"]
    assert last.prompt_token_ids == [5, 6]
    if kind == RequestOutputKind.CUMULATIVE:
        assert len(last.outputs[0].token_ids) == len(seen) - 1


def _slow_to_read_prompts(engine: FakeEngine) -> FakeEngine:
    """Each prompt takes 0.2 s to read: time for an abort to land while it is read."""
    read = engine.process_inputs

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return read(*args, **kwargs)

    engine.process_inputs = slow
    return engine


def test_an_abort_while_the_prompt_is_read_keeps_the_request_out_of_the_engine():
    """The abort found the stream (registered first) and took it away, then the add went on:
    the request ran in the engine for nobody, and its stream never ended."""
    async def main():
        llm = AsyncLLM(_slow_to_read_prompts(FakeEngine()))
        adding = asyncio.create_task(llm.add_request("x", {"prompt_token_ids": [5, 6]},
                                                     params(max_tokens=3)))
        await asyncio.sleep(0.05)
        await llm.abort("x")
        stream = await adding
        out = await asyncio.wait_for(stream.__anext__(), 5)
        stats = await llm.get_stats()
        llm.shutdown()
        return out, stats

    out, stats = run(main())
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert stats["num_running"] == 0


def test_an_old_consumer_leaving_after_an_abort_spares_the_ids_new_request():
    """llm.abort(id) from elsewhere, the id added again, then the old consumer closes its
    generator: its cleanup aborted by id, so the new request ended "abort" after one output."""
    async def main():
        llm = AsyncLLM(FakeEngine(step_delay=0.01))
        old = llm.generate({"prompt_token_ids": [5, 6]}, params(max_tokens=1000), "x")
        await old.__anext__()
        await llm.abort("x")
        new = llm.generate({"prompt_token_ids": [9, 8]}, params(max_tokens=4), "x")
        outs = [await new.__anext__()]
        await old.aclose()
        outs += [o async for o in new]
        llm.shutdown()
        return outs

    outs = run(main())
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, None, "length"]


def test_a_refused_add_after_an_abort_spares_the_ids_new_request():
    """An add still reading its prompt is aborted and its id added again; the first add is then
    refused (ValueError): it unregistered the new request's stream, which then ended "abort"."""
    async def main():
        llm = AsyncLLM(_slow_to_read_prompts(FakeEngine()))
        bad = asyncio.create_task(llm.add_request("x", {"prompt_token_ids": [10**6]},
                                                  params(max_tokens=3)))
        await asyncio.sleep(0.05)
        await llm.abort("x")
        good = asyncio.create_task(llm.add_request("x", {"prompt_token_ids": [5, 6]},
                                                   params(max_tokens=3)))
        with pytest.raises(ValueError):
            await bad
        outs = [o async for o in await good]
        llm.shutdown()
        return outs

    outs = run(main())
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, "length"]
