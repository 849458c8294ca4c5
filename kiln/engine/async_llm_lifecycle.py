"""`AsyncLLM`'s life's end: the engine dying (its step loop failed, its core process died),
which fails every in-flight stream with `EngineDeadError`, or shutting down, which ends them as
aborted (finish_reason "abort", as vLLM's); later requests are refused either way.
"""
import asyncio
import time


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
            raise EngineShutdownError("the engine is shut down")
        if self._refusing is not None:
            raise EngineShutdownError(self._refusing)

    async def abort_all(self, reason: str) -> int:
        """Abort every in-flight request, as vLLM's engine does at shutdown: each stream ends
        with what it generated and finish_reason "abort" (a crash fails them with an error
        instead); later requests are refused with EngineShutdownError(reason). Returns how
        many were aborted."""
        self._refusing = reason
        if self._dead is not None or self._closed or not self._streams:
            return 0
        streams = list(self._streams.values())
        await self.abort([s.request_id for s in streams])
        return len(streams)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let in-flight requests finish for up to `drain_timeout` s, abort the rest, stop."""
        if self._closed:
            return
        deadline = time.monotonic() + drain_timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.abort_all("the engine shut down; request aborted")
        self._closed = True
        await self._steps.stop()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await self._on_engine_thread(shutdown)
        self._steps.close()
        self._frontend.shutdown()
