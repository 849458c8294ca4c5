"""`AsyncLLM`: many coroutines share one `LLMEngine`; a background task runs its step loop.

Engine calls (add, abort, step, stats) run on one engine thread, in order, so an abort never races
a step (step_loop.py); tokenizing and templates run on a front-end thread, so a big prompt never
delays a step; each request's outputs reach its stream (in_flight_streams.py).
"""
import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from kiln.core.request_queue import check_priority
from kiln.engine.async_llm_control import AsyncLLMControl
from kiln.engine.async_llm_lifecycle import (  # noqa: F401 (EngineShutdownError re-exported)
    AsyncLLMLifecycle,
    EngineDeadError,
    EngineShutdownError,
    weakly,
)
from kiln.engine.engine_token_stats import StepTokens
from kiln.engine.frontend_lanes import FrontendLanes
from kiln.engine.in_flight_streams import InFlightStreams
from kiln.engine.request_stats import IterationStats, StatLogger
from kiln.engine.request_stream import RequestStream
from kiln.engine.step_loop import StepLoop, StepLoopClosed
from kiln.engine.text_encoding import check_request_id
from kiln.logger import init_logger
from kiln.lora.frontend import with_lora
from kiln.outputs import RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class AsyncLLM(AsyncLLMLifecycle, AsyncLLMControl):
    def __init__(self, engine, stat_loggers: Iterable[StatLogger] = ()):
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self._steps = StepLoop(engine, self._on_step, self._fail_all)
        # Tokenizer and template work: one thread for ordinary inputs, one (at a lower OS
        # priority) for huge ones; more would take cores from the engine.
        self._frontend = FrontendLanes()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called on the event loop once the engine died (the server exits non-zero).
        self.dead_callbacks: list[Callable[[BaseException], None]] = []
        self._streams = InFlightStreams(self._record_stats)
        self._dead: BaseException | None = None
        self._closed = False
        self._refusing: str | None = None  # set by abort_all: new requests are refused
        # shutdown() may come from any thread, twice at once: the second waits for the first.
        self._shutdown_lock = threading.Lock()
        self.last_stats: dict = {}
        # The server's cap on one call's prompts x n (None: no cap): serving_engine.submit.
        self.max_sequences_per_request: int | None = None
        add_death_callback = getattr(engine, "add_death_callback", None)
        if add_death_callback is not None:
            # Held weakly: the engine's finalizer holds its core client, which holds the
            # callbacks, so a strong one kept this AsyncLLM and the engine alive for good (a
            # dropped AsyncLLM never stopped its engine core process, as vLLM's __del__ does).
            add_death_callback(weakly(self._core_died))

    @classmethod
    def from_engine_args(cls, engine_args, stat_loggers: Iterable[StatLogger] = ()) -> "AsyncLLM":
        from kiln.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args, served=True), stat_loggers)

    # ---- properties the server reads -------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def kiln_config(self):
        return self.engine.kiln_config

    @property
    def max_model_len(self) -> int:
        """The engine's (the config's, or lower where the KV cache holds less)."""
        return self.engine.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.engine.num_blocks

    @property
    def num_threads(self) -> int | None:
        return getattr(self.engine, "num_threads", None)

    @property
    def core_pid(self) -> int | None:
        """The engine core's process (this one's when it runs in-process)."""
        return getattr(getattr(self.engine, "engine_core", None), "pid", None)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closed and self._refusing is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- thread helpers ----------------------------------------------------------------------
    async def run_in_engine(self, fn: Callable, *args, **kwargs) -> Any:
        """Run tokenizer or template work `fn(*args, **kwargs)` off the event loop, on a
        front-end thread: the engine keeps stepping meanwhile (the name is the old one, from
        when they shared one). Pass the text as an argument, not inside a closure: its size
        picks the thread (frontend_lanes.py), so short inputs never wait behind a huge one."""
        self.start()
        try:
            future = self._frontend.submit(fn, *args, **kwargs)
        except RuntimeError:  # its threads are gone: a shutdown (maybe from another thread)
            self._check_alive()
            raise
        return await asyncio.wrap_future(future)

    async def _on_engine_thread(self, fn: Callable, *args, **kwargs) -> Any:
        """Run an engine call on the engine thread, between steps."""
        if self._steps.closed:
            self._check_alive()  # the engine thread is gone: say why
        self.start()
        try:
            return await self._steps.run(fn, *args, **kwargs)
        except StepLoopClosed:  # a shutdown from another thread closed it since the check
            self._check_alive()
            raise

    def start(self) -> None:
        """Note the event loop (the server calls it at start-up): a core that dies while no
        request runs is reported there."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            self._move_to(loop)

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """A later loop (a script's second asyncio.run, a notebook's new loop) takes the engine
        over from one that stopped: the step loop's wake event and task were bound to the old
        one, whose first wait then failed the engine for good ("restart the server")."""
        if self._loop.is_running():
            raise RuntimeError("this AsyncLLM is in use by an event loop running in another "
                               "thread; submit to that loop (asyncio.run_coroutine_threadsafe)")
        # The old loop's requests have no consumer left to read them: abort them here, ending
        # no stream (their waiters belong to the old loop).
        ids = self._streams.forget(list(self._streams), end_streams=False)
        if ids:
            self._steps.submit(self._abort_logged, ids)
        self._steps.leave(self._loop)
        self._loop = loop

    # ---- requests --------------------------------------------------------------------------
    async def process_inputs(self, prompt, params: SamplingParams, *,
                             max_tokens_must_fit: bool = False):
        """Tokenize and validate on the front-end thread (the engine steps on meanwhile);
        raises ValueError; queues nothing. The result goes to add_request(processed=)."""
        self._check_alive()
        # The engine always streams deltas to us; the stream rebuilds the kind the caller wants.
        engine_params = params.clone()
        engine_params.output_kind = RequestOutputKind.DELTA
        return await self.run_in_engine(self.engine.process_inputs, prompt, engine_params,
                                        max_tokens_must_fit=max_tokens_must_fit)

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None, *,
                          max_tokens_must_fit: bool = False, processed=None,
                          priority: int = 0, lora_request=None) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt or params) before anything is queued.
        `arrival_time`: time.monotonic() when it arrived (vLLM's is time.time()).
        `max_tokens_must_fit`: refuse a max_tokens past max_model_len instead of cutting it.
        `processed`: process_inputs()'s result for this prompt and params (then not redone).
        `priority`: vLLM's; lower is served first under --scheduling-policy priority."""
        check_priority(priority)  # before the stream registers: a refusal leaves nothing behind
        check_request_id(request_id)
        self._check_alive()
        self.start()  # before the stream registers: a move to a new loop aborts the old ones
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight; ids must be unique")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, params, arrival_time)
        self._streams[request_id] = stream
        try:
            if processed is None:  # vLLM's lora_request: the prompt carries it (kiln/lora/)
                processed = await self.process_inputs(with_lora(prompt, lora_request), params,
                                                      max_tokens_must_fit=max_tokens_must_fit)
            self._check_alive()
            stream.accepted(processed)
            if self._streams.get(request_id) is not stream:
                stream.put_abort()  # aborted while its prompt was read: it never runs
                return stream
            await self._on_engine_thread(self._add_on_engine_thread, stream, processed,
                                         arrival_time, priority)
        except ValueError:
            self._streams.drop(stream)  # refused: nothing entered the engine
            raise
        except EngineShutdownError:
            # The shutdown (or abort_all) began after this request was accepted, while its
            # prompt was read: it ends as aborted, as those already in the engine do (only a
            # request that arrives after the shutdown began is refused, by the check above).
            if self._streams.get(request_id) is stream:  # a shutdown from another thread:
                self._streams.forget(request_id)  # its end of the streams is still queued
            stream.put_abort()
            return stream
        except BaseException as e:
            # Cancelled while the engine thread was adding it: it may be in; take it out again
            # (unless an abort took it already: the id may name a new request by now).
            if self._streams.drop(stream):
                self._steps.submit(self._abort_logged, [request_id])
            from kiln.engine.core_errors import engine_gone

            if engine_gone(e):  # a request racing the death, before the watcher told us
                raise EngineDeadError(f"the engine failed: {e!r}; restart the server") from e
            raise
        self._steps.kick()
        return stream

    def _add_on_engine_thread(self, stream: RequestStream, processed, arrival_time,
                              priority: int = 0) -> None:
        stream.engine = self.engine.add_processed_request(stream.request_id, processed,
                                                          arrival_time, priority=priority)
        stream.first_step = self._steps.steps_run + 1

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                        lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            # Only while the id is still ours: after llm.abort(id) from elsewhere the caller
            # may have added the id again, and that request is not this consumer's to abort.
            if not stream.finished and self._streams.get(request_id) is stream:
                self.abort_nowait(request_id)

    async def abort(self, request_ids: str | list[str], record: bool = True,
                    end_streams: bool = True) -> None:
        """Abort requests and wait until the engine has freed their KV blocks; their streams
        end with a final "abort" output (`end_streams=False`: the caller ends them). `record=
        False` takes back requests of a call that was refused: no abort enters the metrics."""
        # A later loop takes over first: the old loop's streams are then let go unended, where
        # ending them here woke waiters of that loop, which raised once it was closed, and the
        # request, already forgotten, ran on in the engine with no consumer.
        self.start()
        ids = self._streams.forget(request_ids, record, end_streams)
        if ids and not self._steps.closed:  # after shutdown nothing runs to abort
            with contextlib.suppress(StepLoopClosed):  # a shutdown since: it aborts them all
                await self._steps.run(self.engine.abort_request, ids)

    def abort_nowait(self, request_ids: str | list[str]) -> None:
        """Abort from code that cannot await (a cancelled coroutine's cleanup)."""
        ids = self._streams.forget(request_ids)
        if ids:
            self._steps.submit(self._abort_logged, ids)

    def _abort_logged(self, ids: list[str]) -> None:
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - an abort must never kill the engine thread
            logger.exception("aborting %s failed", ids)

    async def get_stats(self) -> dict:
        """Fresh engine stats, taken between steps (after any queued abort has run)."""
        self.last_stats = await self._on_engine_thread(self.engine.get_stats)
        return self.last_stats

    async def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return await self.run_in_engine(self.engine.apply_chat_template, messages, **kwargs)

    async def chat_prompt(self, messages: list[dict], **kwargs) -> dict:
        """{"prompt": rendered text, "prompt_token_ids": ids} for a conversation."""
        return await self.run_in_engine(self.engine.chat_prompt, messages, **kwargs)

    def _on_step(self, outputs: list[RequestOutput], core_steps: list[StepTokens],
                 stats: dict, step: int) -> None:
        """The step loop's outputs, on the event loop."""
        self.last_stats = stats
        self._streams.dispatch(outputs, core_steps, step)

    def _record_stats(self, stats: IterationStats) -> None:
        """A step's or an abort's stats to every stat logger, with the engine's latest."""
        for sl in self.stat_loggers:
            sl.record(stats, self.last_stats)
