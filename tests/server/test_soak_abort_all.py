"""AsyncLLM.abort_all (the server's end of the shutdown grace period), on a fake engine: every
open stream ends as aborted (finish_reason "abort", as vLLM's engine ends them at shutdown, not
a crash's error), the engine frees them, later requests are refused as shut down."""
import asyncio

import pytest

from kiln.engine.async_llm import AsyncLLM, EngineShutdownError
from kiln.sampling_params import RequestOutputKind, SamplingParams

from .fake_engine import FakeEngine

REASON = "the server is shutting down"


def test_abort_all_fails_open_streams_and_refuses_new_requests():
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        streams = [await llm.add_request(f"r{i}", f"prompt {i}", params) for i in range(3)]
        first = await streams[0].__anext__()  # running: one output already out
        assert not first.finished
        assert await llm.abort_all(REASON) == 3
        for stream in streams:
            rest = [out async for out in stream]
            assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        assert llm.num_in_flight == 0 and not engine.has_unfinished_requests()
        assert not llm.is_running
        with pytest.raises(EngineShutdownError, match=REASON):
            await llm.add_request("late", "prompt", params)
        assert await llm.abort_all(REASON) == 0
        llm.shutdown()

    asyncio.run(main())
