"""`serve()`: the app build_app makes, run by uvicorn until a stop signal or the engine's death;
the grace period, then in-flight requests aborted in-band, and the exit code.

SIGINT / SIGTERM: uvicorn stops accepting, in-flight requests get the grace period, then the engine
aborts what is left, as vLLM's does: each ends with what it generated and finish_reason "abort"
(a stream's last chunk, then `data: [DONE]`; a waiting non-streamed request's answer; a beam
search's beams so far, whether a step or the gap between two was cut), apart from a crash's
error (code engine_dead); later requests get a 503 with code server_shutting_down; the
app's shutdown stops the engine; the process exits with 0.
A second signal ends the grace period at once; a third exits at once (128 + the signal).
An engine core that dies fails every request in flight at once; the server then exits with 1.
"""
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

import uvicorn

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.http_protocol import hardened_protocol
from kiln.entrypoints.openai.server_settings import ServerSettings
from kiln.entrypoints.openai.server_tls import uvicorn_tls_config
from kiln.logger import init_logger

logger = init_logger(__name__)


# After the grace period, handlers have this long to report the abort before uvicorn cancels
# them (which cuts a stream mid-body and logs a traceback): only a client that stopped reading
# needs it.
_REPORT_ABORT_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal after a graceful shutdown, plus
    ending in-flight requests in-band once the grace period is over."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, grace_s: float,
                 stop_signal: Callable[[], int | None]):
        super().__init__(config)
        self.llm = llm
        self.grace_s = grace_s
        self.stop_signal = stop_signal
        self.stopped_early: int | None = None  # a signal that came before serving
        self._num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grace_over: asyncio.Event | None = None  # set by a second stop signal

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._grace_over = asyncio.Event()
        await super().serve(sockets)

    async def shutdown(self, sockets=None) -> None:
        ender = asyncio.create_task(self._end_in_flight())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _wait_tasks_to_complete(self) -> None:
        await super()._wait_tasks_to_complete()
        # Background responses hold no connection uvicorn waits for: they get the grace period
        # too (its end aborts them with the rest; the app's shutdown cancels what is left).
        background = getattr(self.config.app.state, "background_responses", None)
        if background is not None and not self.force_exit:
            await background.wait_idle()

    async def _end_in_flight(self) -> None:
        try:
            await asyncio.wait_for(self._grace_over.wait(), self.grace_s)
            why = "a second stop signal"
        except TimeoutError:
            why = f"the {self.grace_s:g} s grace period (--graceful-shutdown-timeout)"
        reason = f"the server is shutting down: request aborted after {why}"
        self.config.app.state.shutdown_gate.close(reason)  # requests still sending their body
        n = await self.llm.abort_all(reason)
        if n:
            logger.warning("shutdown: aborted %d request(s) still in flight after %s", n, why)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self._on_signal)
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        # One that came during start-up, whose SystemExit was swallowed (in a __del__, say):
        # the server stops at once rather than serve on.
        self.stopped_early = self.stop_signal()
        if self.stopped_early is not None:
            self._on_signal(self.stopped_early, None)
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        """The first stop signal starts the grace period; a second ends it at once, each
        request in flight ending in-band (uvicorn's force quit on a second Ctrl-C cut streams
        mid-body, answered plain-text 500s and skipped the engine's shutdown); a third exits
        the process at once."""
        self._num_signals += 1
        name = signal.Signals(sig).name
        if self._num_signals == 1:
            logger.info("received %s: finishing in-flight requests, then exiting (a second "
                        "signal aborts them at once)", name)
            self.should_exit = True
        elif self._num_signals == 2:
            logger.warning("received %s again: aborting the requests in flight now (a third "
                           "signal quits without waiting for them)", name)
            self.should_exit = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._grace_over.set)
        else:
            # uvicorn's force_exit skipped the app's shutdown and logged the lifespan's
            # CancelledError, and did nothing while that shutdown ran: leave now, as a kill
            # would (the engine core and its ranks exit when this process is gone).
            logger.warning("received %s a third time: quitting now, without shutting the "
                           "engine down", name)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(128 + sig)


def serve(llm: AsyncLLM, settings: ServerSettings, sock: socket.socket | None = None,
          stop_signal: Callable[[], int | None] = lambda: None) -> int:
    """Serve until SIGINT / SIGTERM (0) or the engine's death (1); blocking. The exit code.
    `sock`: a socket already bound to the address (else uvicorn binds it). `stop_signal`: a
    stop signal that reached this process before serving began, if any (then 128 + it)."""
    app = build_app(llm, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            http=hardened_protocol(settings.request_header_timeout,
                                                     settings.response_send_timeout),
                            log_level=settings.log_level, access_log=settings.access_log,
                            timeout_graceful_shutdown=(settings.graceful_shutdown_timeout
                                                       + _REPORT_ABORT_S),
                            timeout_keep_alive=settings.timeout_keep_alive, lifespan="on",
                            **uvicorn_tls_config(settings))
    server = _Server(config, llm, settings.graceful_shutdown_timeout, stop_signal)
    exit_code = 0

    def on_engine_dead(error: BaseException) -> None:
        nonlocal exit_code
        logger.error("the engine died (%s): the server stops", error)
        exit_code = 1
        server.should_exit = True

    llm.dead_callbacks.append(on_engine_dead)
    server.run(sockets=[sock] if sock is not None else None)
    if not server.started:
        raise RuntimeError(f"the server did not start on {settings.host}:{settings.port} "
                           "(port in use?); pick another with --port")
    logger.info("server stopped")
    if exit_code == 0 and server.stopped_early is not None:
        return 128 + server.stopped_early
    return exit_code
