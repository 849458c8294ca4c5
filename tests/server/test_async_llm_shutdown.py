"""vLLM's synchronous `AsyncLLM.shutdown()` on a real engine core process: a plain call (not
awaited) inside a running event loop stops the core, aborts what is in flight, and later calls
are harmless; from another thread too (fake engine), racing a step's end; a dropped AsyncLLM
stops its core too."""
import asyncio
import gc
import os
import select
import threading
import weakref

import pytest

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM, EngineShutdownError
from kiln.sampling_params import SamplingParams

from .fake_engine import FakeEngine


def _exited(pid: int) -> bool:
    """Whether `pid` exits (within a minute): a core that said goodbye may still be exiting
    when shutdown() returns, a while on a loaded machine."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        select.select([fd], [], [], 60)  # readable once it exited (zombie or reaped)
    finally:
        os.close(fd)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie nobody reaped yet is gone too
            return f.read().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped since the kill found it (at the
        return True  # open, or between the open and the read: ESRCH)


def test_plain_shutdown_in_a_running_loop_stops_the_core_process(tiny_llama_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama_dir), enforce_eager=True,
                                               dtype="float32", max_model_len=64))
    pid = llm.core_pid
    assert pid is not None and pid != os.getpid()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await llm.add_request("a", "hello", params)
        await stream.__anext__()
        assert llm.shutdown() is None  # vLLM's: a plain method, no coroutine to forget
        rest = [out async for out in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        llm.shutdown()  # twice: nothing more to do
        llm.shutdown(timeout=1.0)
        with pytest.raises(EngineShutdownError, match=r"shut down \(shutdown\(\)\)"):
            async for _ in llm.generate("hello", params, "b"):
                pass
        await asyncio.sleep(0)  # the cancelled step task ends on its next turn

    asyncio.run(main())
    assert _exited(pid), "the engine core process outlived AsyncLLM.shutdown()"
    assert llm.engine.engine_core is None
    assert not llm.is_running


def test_shutdown_from_another_thread_ends_the_loops_streams():
    """A thread other than the loop's (a signal handler's, a test harness's): the streams end on
    their own loop, the engine thread stops the engine."""
    async def main():
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine)
        stream = await llm.add_request("a", "x", SamplingParams(temperature=0, max_tokens=1000))
        await stream.__anext__()
        stopper = threading.Thread(target=llm.shutdown)
        stopper.start()
        rest = [out async for out in stream]
        stopper.join()
        assert rest[-1].outputs[0].finish_reason == "abort"
        return engine

    engine = asyncio.run(main())
    assert engine.shut_down and engine.aborted == ["a"]


class _GatedEngine(FakeEngine):
    """Its second step waits for `gate`."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.in_step = threading.Event()
        self.steps = 0

    def step(self):
        self.steps += 1
        if self.steps == 2:
            self.in_step.set()
            self.gate.wait()
        return super().step()


def test_shutdown_from_another_thread_racing_a_finished_step_aborts():
    """A step ends, then another thread's shutdown closes the engine thread before the event
    loop resumes the step task: the task's next step could not be scheduled, and that was
    taken for the engine's death (every stream failed with EngineDeadError, a traceback)."""
    async def main():
        engine = _GatedEngine()
        llm = AsyncLLM(engine)
        stream = await llm.add_request("a", "x", SamplingParams(temperature=0, max_tokens=1000))
        await stream.__anext__()
        await asyncio.to_thread(engine.in_step.wait)
        # The loop's thread is held while the step ends; one turn of the loop moves its result
        # to the step task's future (the task's wake-up is queued); the loop's thread is held
        # again while the shutdown runs: the step task resumes before the shutdown's callback.
        engine.gate.set()
        llm._steps.submit(lambda: None).result()  # the step's result is queued to the loop
        await asyncio.sleep(0)
        stopper = threading.Thread(target=llm.shutdown)
        stopper.start()
        stopper.join()
        rest = [out async for out in stream]
        assert rest[-1].outputs[0].finish_reason == "abort"
        assert llm._dead is None and not llm.is_running
        with pytest.raises(EngineShutdownError):
            await llm.get_stats()

    asyncio.run(main())


def test_a_dropped_async_llm_stops_its_core_process(tiny_llama_dir):
    """vLLM's AsyncLLM stops its core when dropped (__del__); Kiln's engine finalizer does,
    once the engine is collected: the death callback AsyncLLM gave the core client held it (and
    so the engine) alive from the finalizer's own reference, and the core process ran on."""
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama_dir), enforce_eager=True,
                                               dtype="float32", max_model_len=64))
    pid = llm.core_pid
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None, "a dropped AsyncLLM's engine was never collected"
    assert _exited(pid), "a dropped AsyncLLM's engine core process ran on"


class _HeldReadEngine(FakeEngine):
    """Reading the prompt "held" waits for `go`, which its shutdown sets: the read ends only
    once a shutdown has begun."""

    def __init__(self):
        super().__init__()
        self.reading, self.go = threading.Event(), threading.Event()

    def process_inputs(self, prompt, params, **kwargs):
        if prompt == "held":
            self.reading.set()
            self.go.wait()
        return super().process_inputs(prompt, params, **kwargs)

    def shutdown(self, timeout=None):
        self.go.set()
        super().shutdown(timeout)


async def _outputs(agen) -> list:
    return [out async for out in agen]


_LONG = SamplingParams(temperature=0, max_tokens=1000)


@pytest.mark.parametrize("how", ["shutdown in the loop", "shutdown from another thread",
                                 "abort_all"])
def test_a_request_whose_prompt_is_read_when_shutdown_begins_ends_as_aborted(how):
    """generate() accepted it before the shutdown began: it ends as those in the engine do
    (finish_reason "abort", test_plain_shutdown_in_a_running_loop_stops_the_core_process),
    where it raised EngineShutdownError; one that arrives after the shutdown began is
    refused."""
    async def main():
        engine = _HeldReadEngine()
        llm = AsyncLLM(engine)
        reading = asyncio.create_task(_outputs(llm.generate("held", _LONG, "reading")))
        await asyncio.to_thread(engine.reading.wait)
        if how == "shutdown in the loop":
            llm.shutdown()  # blocks until the read ends: its engine's shutdown lets it end
        elif how == "shutdown from another thread":
            await asyncio.to_thread(llm.shutdown)
        else:
            assert await llm.abort_all("draining") == 1
            engine.go.set()
        outs = await reading
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert outs[-1].outputs[0].token_ids == []
        with pytest.raises(EngineShutdownError):
            await llm.add_request("late", "x", _LONG)
        assert not llm.num_in_flight and "reading" not in engine.requests
        if how != "abort_all":
            assert engine.shut_down
        else:
            llm.shutdown()

    asyncio.run(main())


def test_front_end_work_after_shutdown_is_refused_as_a_shutdown():
    """chat_prompt / apply_chat_template / run_in_engine after shutdown(): the front-end
    threads are gone; that raised the executor's RuntimeError ("cannot schedule new futures
    after shutdown", a 500 at the server) instead of EngineShutdownError."""
    async def main():
        llm = AsyncLLM(FakeEngine())
        llm.start()
        llm.shutdown()
        messages = [{"role": "user", "content": "hi"}]
        for call in (lambda: llm.chat_prompt(messages),
                     lambda: llm.apply_chat_template(messages),
                     lambda: llm.run_in_engine(len, "abc")):
            with pytest.raises(EngineShutdownError):
                await call()

    asyncio.run(main())


@pytest.mark.parametrize("nth_start", [2, 3])
def test_a_shutdown_from_another_thread_between_a_check_and_a_submit_aborts(nth_start):
    """Another thread's shutdown lands after add_request checked the engine but before it
    hands work to a thread the shutdown closed (2: the prompt's read, on the front end; 3: the
    add, on the engine thread): the request, accepted, ends as aborted; it raised RuntimeError
    ("cannot schedule new futures after shutdown")."""
    async def main():
        llm = AsyncLLM(FakeEngine())
        starts = 0
        start = llm.start

        def start_then_shutdown():
            nonlocal starts
            start()
            starts += 1
            if starts == nth_start:  # as if the other thread ran just here
                stopper = threading.Thread(target=llm.shutdown)
                stopper.start()
                stopper.join()

        llm.start = start_then_shutdown
        outs = await _outputs(llm.generate("x", _LONG, "racing"))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert not llm.num_in_flight

    asyncio.run(main())


def test_an_abort_that_meets_a_shutdown_from_another_thread_returns():
    """abort() checked the engine thread open, then another thread's shutdown closed it
    before the abort was handed over: the shutdown aborts everything itself; abort() raised
    (RuntimeError, then EngineShutdownError) into callers such as abort_all."""
    async def main():
        llm = AsyncLLM(FakeEngine())
        stream = await llm.add_request("a", "x", _LONG)
        await stream.__anext__()
        run = llm._steps.run

        async def shutdown_then_run(fn, *args):
            stopper = threading.Thread(target=llm.shutdown)  # as if it ran just here
            stopper.start()
            stopper.join()
            return await run(fn, *args)

        llm._steps.run = shutdown_then_run
        assert await llm.abort_all("draining") == 1
        rest = [out async for out in stream]
        assert rest[-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())


def test_a_consumer_leaving_as_a_shutdown_closes_the_engine_thread_leaves_quietly():
    """A consumer that leaves early hands its abort over without waiting (abort_nowait, from
    the generator's cleanup); a shutdown from another thread that closed the engine thread
    between the step loop's check and its submit raised the executor's RuntimeError ('cannot
    schedule new futures after shutdown') out of that cleanup. The shutdown aborts it."""
    async def main():
        llm = AsyncLLM(FakeEngine())
        pool = llm._steps._pool
        submit = pool.submit

        def shutdown_then_submit(fn, *args, **kwargs):
            pool.submit = submit  # the shutdown's own submits go through
            stopper = threading.Thread(target=llm.shutdown)  # as if it ran just here
            stopper.start()
            stopper.join()
            return submit(fn, *args, **kwargs)

        outputs = llm.generate("x", _LONG, "a")
        await outputs.__anext__()
        pool.submit = shutdown_then_submit
        await outputs.aclose()  # leaves early: abort_nowait
        assert not llm.num_in_flight

    asyncio.run(main())


class _StopsForGoodEngine(FakeEngine):
    """As LLMEngine: a call after its shutdown raises RuntimeError."""

    def add_processed_request(self, *args, **kwargs):
        if self.shut_down:
            raise RuntimeError("this engine was shut down (shutdown())")
        return super().add_processed_request(*args, **kwargs)

    def get_stats(self):
        if self.shut_down:
            raise RuntimeError("this engine was shut down (shutdown())")
        return super().get_stats()


@pytest.mark.parametrize("call", ["add", "get_stats"])
def test_an_engine_call_handed_over_just_after_a_shutdowns_stop_is_refused(call):
    """Another thread's shutdown has queued the engine's stop but not yet closed the engine
    thread when the loop hands over an engine call (it checked the engine alive just before):
    the call ran after the stop, on a stopped engine, and its RuntimeError reached the caller
    (a 500 at the server) where the request ends as aborted, a control call as a shutdown."""
    async def main():
        llm = AsyncLLM(_StopsForGoodEngine())
        await llm.get_stats()
        steps = llm._steps
        at_close, handed = threading.Event(), threading.Event()
        close, submit = steps.close, steps._pool.submit

        def close_once_handed():  # the shutdown's thread, its stop queued
            at_close.set()
            handed.wait()
            close()

        def submit_then_release(*args, **kwargs):
            future = submit(*args, **kwargs)
            if at_close.is_set():
                handed.set()
            return future

        def start_then_race():  # the loop's thread, the engine checked alive
            nonlocal starts
            start()
            starts += 1
            if starts == nth_start:  # _on_engine_thread's, before it hands the call over
                steps.close = close_once_handed
                steps._pool.submit = submit_then_release
                stopper.start()
                at_close.wait()

        start, starts, stopper = llm.start, 0, threading.Thread(target=llm.shutdown)
        nth_start = 3 if call == "add" else 1  # add_request's and the prompt read's first
        llm.start = start_then_race
        if call == "add":
            outs = await _outputs(llm.generate("x", _LONG, "racing"))
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        else:
            with pytest.raises(EngineShutdownError):
                await llm.get_stats()
        await asyncio.to_thread(stopper.join)
        assert not llm.num_in_flight

    asyncio.run(main())
