"""`AsyncLLM`'s life's end: the engine dying (its step loop failed, its core process died),
which fails every in-flight stream with `EngineDeadError`, or shutting down, which ends them as
aborted (finish_reason "abort", as vLLM's); later requests are refused either way.

In flight means accepted: past add_request's (generate's) first check, as vLLM's add_request
checks the engine's state on entry only; a request whose prompt is still being read when the
shutdown begins ends as aborted too, and one that arrives after is refused (EngineShutdownError).
"""
import asyncio
import time
import weakref
from collections.abc import Callable

_SHUT_DOWN = "the engine shut down (AsyncLLM.shutdown()); request aborted"


def weakly(method: Callable) -> Callable:
    """`method`, called only while its object lives (a callback that must not keep it alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


class EngineDeadError(RuntimeError):
    """The step loop raised, the core process died, or the engine shut down; in-flight and
    later requests get this."""


class EngineShutdownError(EngineDeadError):
    """The engine is shutting down (or shut down) on purpose: later requests get this, so a
    client can tell a deliberate stop (retry elsewhere) from a crash."""


class AsyncLLMLifecycle:
    """Mixed into `AsyncLLM` (async_llm.py), whose state and helpers these methods use."""

    def _core_died(self, error: BaseException) -> None:
        """From the core client's watcher thread."""
        if self._loop is None or self._loop.is_closed():
            self._dead = self._dead or error
            return
        try:
            self._loop.call_soon_threadsafe(self._fail_all, error)
        except RuntimeError:  # the loop closed meanwhile
            self._dead = self._dead or error

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: every stream ends with an error, later requests are refused."""
        first = self._dead is None
        if first:
            self._dead = error
        self._streams.fail_all(EngineDeadError(f"the engine loop failed: {error!r}"))
        if first and not self._closed:
            for callback in self.dead_callbacks:
                callback(error)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}; restart the server")
        if self._closed:
            raise EngineShutdownError("this AsyncLLM was shut down (shutdown()); create a new "
                                      "one to generate again")
        if self._refusing is not None:
            raise EngineShutdownError(self._refusing)

    async def abort_all(self, reason: str) -> int:
        """Abort every in-flight request, as vLLM's engine does at shutdown: each stream ends
        with what it generated and finish_reason "abort" (those whose prompt is still being
        read too; a crash fails them with an error instead); later requests are refused
        with EngineShutdownError(reason). Returns how many were aborted."""
        self._refusing = reason
        if self._dead is not None or self._closed or not self._streams:
            return 0
        streams = list(self._streams.values())
        await self.abort([s.request_id for s in streams])
        return len(streams)

    async def drain_and_shutdown(self, drain_timeout: float = 0.0,
                                 timeout: float | None = None) -> None:
        """The server's graceful end: let in-flight requests finish for up to `drain_timeout`
        s, abort the rest (each stream ends with finish_reason "abort"), stop the step loop
        cleanly on this event loop, then `shutdown(timeout)` off it (the core's exit never
        stalls the handlers still reporting their aborts)."""
        if self._closed:
            return
        deadline = time.monotonic() + drain_timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.abort_all(_SHUT_DOWN)
        await self._steps.stop()
        await asyncio.to_thread(self.shutdown, timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """vLLM's AsyncLLM.shutdown: synchronous and idempotent, callable from any thread,
        inside a running event loop too. Requests in flight end as aborted (finish_reason
        "abort"; those whose prompt is still being read too), the step loop stops, the
        engine core is stopped (`timeout`: the seconds its process gets to exit in order before
        it is killed; None: the client's default), and later requests raise
        EngineShutdownError. `drain_and_shutdown` lets them finish first."""
        with self._shutdown_lock:
            if self._steps.closed:  # shut down already
                return
            self._closed = True
            self._refusing = self._refusing or _SHUT_DOWN
            in_flight = list(self._streams)
            self._on_loop(self._end_streams_and_steps)
            # The engine thread finishes the step it is in, then stops the engine; nothing there
            # waits for the event loop, so blocking the loop's own thread here cannot deadlock.
            if in_flight and self._dead is None:  # the engine frees them before it stops
                self._steps.submit(self._abort_logged, in_flight)
            stop = getattr(self.engine, "shutdown", None) or (lambda timeout: None)
            stopping = self._steps.submit_last(stop, timeout=timeout)
            try:
                self._steps.close()
            finally:
                self._frontend.shutdown()
            if stopping is not None:
                stopping.result()  # the engine's own shutdown error, if any, to the caller

    def _on_loop(self, fn) -> None:
        """`fn(loop_gone)` where the event loop's objects (streams, the step task) may be touched: now
        on the loop's own thread or with no loop running, else queued to the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            fn(loop_gone=loop is not None)  # a closed loop's waiters can no longer be woken
            return
        if not loop.is_running():
            fn(loop_gone=False)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(loop_gone=False)
        else:
            loop.call_soon_threadsafe(fn, False)

    def _end_streams_and_steps(self, loop_gone: bool = False) -> None:
        """Every stream in flight ends as aborted (unended where its loop is gone: nobody waits
        there), and the step task stops."""
        self._streams.forget(list(self._streams), end_streams=not loop_gone)
        self._steps.cancel()
