"""`StepLoop`: AsyncLLM's engine thread, where every engine call runs in order, and the task that
steps the engine there while requests are in flight, handing on each step's outputs.
"""
import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from kiln.engine.engine_token_stats import StepTokens
from kiln.logger import init_logger
from kiln.outputs import RequestOutput

logger = init_logger(__name__)


class StepLoopClosed(RuntimeError):
    """An engine call came after the engine thread closed (AsyncLLM.shutdown)."""


class StepLoop:
    """`on_step(outputs, core_steps, stats, step)` gets each step's outputs on the event loop;
    `on_failure(error)` the error a step raised, after which the loop has stopped."""

    def __init__(self, engine, on_step: Callable, on_failure: Callable[[BaseException], None]):
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-engine")
        self._pool_closed = False
        # Set on the engine thread by its last call (submit_last): a call handed over after
        # it, in a shutdown's race, must not run on the stopped engine.
        self._ended = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopped = False
        # Steps run on the engine thread (read and written there only): a step's outputs go to
        # a stream only if its add ran before that step (RequestStream.first_step).
        self.steps_run = 0

    async def run(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` on the engine thread, between steps; StepLoopClosed where
        the thread is closed (a shutdown from another thread may close it at any time)."""
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: self._unless_ended(fn, args, kwargs))
        except RuntimeError:
            if self._pool_closed:
                raise StepLoopClosed("the engine thread is closed (shutdown)") from None
            raise
        return await future

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future | None:
        """`fn(*args, **kwargs)` on the engine thread, not waited for; nothing (None) once the
        thread is closed (a shutdown from another thread may close it after the check)."""
        if self._pool_closed:
            return None
        try:
            return self._pool.submit(self._unless_ended, fn, args, kwargs)
        except RuntimeError:
            if self._pool_closed:
                return None
            raise

    def submit_last(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future | None:
        """`submit` as the engine thread's last call (the engine's stop): a call handed over
        after it (a shutdown from another thread queues it before closing the thread) raises
        StepLoopClosed there instead of running on the stopped engine."""
        def last():
            self._ended = True
            return fn(*args, **kwargs)
        return self.submit(last)

    def _unless_ended(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if self._ended:
            raise StepLoopClosed("the engine thread is closed (shutdown)")
        return fn(*args, **kwargs)

    def kick(self) -> None:
        """Step until no request is left (the task starts on the running event loop)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="kiln-engine-loop")
        self._wake.set()

    def leave(self, old_loop: asyncio.AbstractEventLoop) -> None:
        """Another event loop takes over from `old_loop`: the wake event and the task were bound
        to it; the next kick makes new ones."""
        if self._task is not None and not self._task.done() and not old_loop.is_closed():
            self._task.cancel()  # it would step beside the new loop's if the old ran again
        self._wake, self._task = None, None

    def _step(self) -> tuple[list[RequestOutput], list[StepTokens], bool, dict, int]:
        outputs = self.engine.step()
        self.steps_run += 1
        return (outputs, list(self.engine.last_steps), self.engine.has_unfinished_requests(),
                self.engine.step_stats(), self.steps_run)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopped:
                await self._wake.wait()
                # Cleared before stepping: an add that lands during the steps below sets it again.
                self._wake.clear()
                more = True
                while more and not self._stopped:
                    outputs, core_steps, more, stats, step = await loop.run_in_executor(
                        self._pool, self._unless_ended, self._step, (), {})
                    self._on_step(outputs, core_steps, stats, step)
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: a loop closed without cancelling this task (run_until_complete,
            # then close) and the task was collected after a later loop took over; no step
            # failed, and failing the engine here refused every later request
            raise
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine died
            if self._stopped or self._pool_closed or self._ended:
                # A shutdown from another thread closed the engine thread (or stopped the
                # engine) before its cancel reached this task: no death, the shutdown ends
                # the streams as aborted.
                return
            logger.exception("engine step loop failed; failing all in-flight requests")
            self._on_failure(e)

    async def stop(self) -> None:
        """Stop stepping; the engine thread still takes calls (close ends it)."""
        self._stopped = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - already logged
                pass

    def cancel(self) -> None:
        """`stop` for code that cannot await (a synchronous shutdown), on the task's loop's
        thread or with that loop stopped: the task ends at its next turn on the loop."""
        self._stopped = True
        task = self._task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()

    @property
    def closed(self) -> bool:
        """The engine thread is closed (shutdown): nothing more runs on it."""
        return self._pool_closed

    def close(self) -> None:
        """End the engine thread, once its queued calls have run."""
        self._pool_closed = True
        self._pool.shutdown(wait=True)
