"""`InFlightStreams`: the streams of AsyncLLM's requests in flight, by request id: each engine
step's outputs routed to theirs, and streams ended by an abort or by the engine's death.
"""
import time
from collections.abc import Callable

from kiln.engine.engine_token_stats import StepTokens
from kiln.engine.request_stats import IterationStats
from kiln.engine.request_stream import RequestStream
from kiln.outputs import RequestOutput


class InFlightStreams(dict[str, RequestStream]):
    """`record(stats)` hands a step's or an abort's IterationStats to the stat loggers."""

    def __init__(self, record: Callable[[IterationStats], None]):
        super().__init__()
        self._record = record

    def drop(self, stream: RequestStream) -> bool:
        """Unregister `stream` if its id still names it; False if an abort took it already."""
        if self.get(stream.request_id) is not stream:
            return False
        del self[stream.request_id]
        return True

    def forget(self, request_ids: str | list[str], record: bool = True,
               end_streams: bool = True) -> list[str]:
        """Unregister aborted requests; returns their ids, for the engine's abort."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            stream = self.pop(rid, None)
            if record and stream is not None and not stream.finished:
                self._record_abort(stream)
            if end_streams and stream is not None:
                stream.put_abort()  # a consumer elsewhere waits on it (as vLLM's ends it)
        return ids

    def _record_abort(self, stream: RequestStream) -> None:
        stats = IterationStats(engine=stream.engine)
        stream.timer.observe_abort(time.monotonic(), stats)
        self._record(stats)

    def dispatch(self, outputs: list[RequestOutput], core_steps: list[StepTokens],
                 step: int) -> None:
        """`core_steps`: each core step the engine counted (its last_steps; none for a poll
        that found no step). `step`: which engine step made `outputs` (StepLoop.steps_run). The
        stat loggers get one IterationStats per replica with steps or outputs (replica 0's when
        there are none)."""
        now = time.monotonic()
        by_engine: dict[int, IterationStats] = {}

        def of(engine: int) -> IterationStats:
            return by_engine.setdefault(engine, IterationStats(engine=engine))

        handed_on = set()  # requests whose outputs reached their stream: what the counters count
        for out in outputs:
            stream = self.get(out.request_id)
            if stream is None or stream.first_step is None or step < stream.first_step:
                # Aborted while the step ran; or its id was used again at once, and these are
                # its namesake's (the step ran before the new add: its outputs reached the
                # new stream, whose text then began with the old request's tokens)
                continue
            handed_on.add(out.request_id)
            stream.timer.observe(out, now, of(stream.engine))
            stream.put_delta(out)
            if out.finished:
                del self[out.request_id]
        # As vLLM's iteration stats: a step's tokens are those the counters count, not an
        # aborted request's that the engine computed meanwhile (its outputs were dropped above).
        for core_step in core_steps:
            kept = core_step.kept(handed_on)
            if kept is not None:
                of(kept.engine).step_tokens.append(kept.tokens)
        for stats in by_engine.values() or [IterationStats()]:
            self._record(stats)

    def fail_all(self, error: BaseException) -> None:
        """The engine is gone: every stream ends with `error`."""
        for stream in self.values():
            stream.put_error(error)
        self.clear()
