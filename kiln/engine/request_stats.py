"""Per-request latency and token bookkeeping (TTFT, inter-token latency, phases, sizes) for stat
loggers.

`AsyncLLM` fills one `IterationStats` per batch of engine steps and hands it to every
`StatLogger`. Units follow vLLM v1, which runs each of a request's n samples as a child request:
each sample is a finished request of its own (success by its own finish reason, e2e, TTFT,
phases, prompt and generated tokens, max_tokens), and its prompt counts as prefilled when its
first token arrives; only `n` and the longest sample's tokens are the user request's, observed
once when all its samples finished.
Phases follow vLLM v1, from the core's first-scheduled time of the sample (a preemption does not
reset it): queue = arrival -> first scheduled, prefill = first scheduled -> first token,
inference = first scheduled -> last token; so queue + prefill = TTFT and inference = prefill +
decode.
"""
from dataclasses import dataclass, field
from typing import Protocol

from kiln.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.spec_decode.stats_log import spec_decoding_line, spec_totals


@dataclass
class IterationStats:
    # The data-parallel replica (engine core) whose requests and steps these are: 0 without
    # data parallel. One IterationStats holds one replica's (vLLM's `engine` label).
    engine: int = 0
    # Prompt + generated tokens of each engine core step with outputs that this batch took in
    # and handed on (the engine's last_steps, less requests aborted meanwhile): none for a poll
    # that found no step, or an abort.
    step_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt once per sample that produced its first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, per sample
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, per sample
    # Finished samples (a request of n finishes n times, as vLLM's child requests): one entry
    # each, in the same order.
    e2e_latencies: list[float] = field(default_factory=list)  # seconds
    finished_reasons: list[str] = field(default_factory=list)
    request_prompt_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_generation_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_params_max_tokens: list[int] = field(default_factory=list)  # the engine's
    # Finished user requests, once all their samples are: one entry each.
    request_max_generation_tokens: list[int] = field(default_factory=list)  # longest sample's
    request_params_n: list[int] = field(default_factory=list)
    # Finished samples that produced a token: first -> last token.
    request_decode_times: list[float] = field(default_factory=list)
    # Finished samples that were scheduled and produced a token, not aborted or failed ones
    # (as vLLM).
    request_queue_times: list[float] = field(default_factory=list)  # arrival -> scheduled
    request_prefill_times: list[float] = field(default_factory=list)  # scheduled -> first token
    request_inference_times: list[float] = field(default_factory=list)  # scheduled -> last token


class StatLogger(Protocol):
    def record(self, iteration: IterationStats, engine_stats: dict) -> None: ...


def finished_reason(out: CompletionOutput) -> str:
    """A finished sample's request_success label: its finish reason, or "error" (vLLM v1's
    label) where the engine ended it for a reason of its own (CompletionOutput.error: its
    grammar allowed no token, the KV cache can never hold it), which the API reports as
    request_failed; a caller's abort stays "abort"."""
    return "error" if out.error is not None else out.finish_reason


@dataclass
class _SampleTimes:
    """One sample's tokens so far and when they arrived."""
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    finished: bool = False


class RequestTimer:
    """Times one request's outputs; writes what it saw this step into an IterationStats."""

    def __init__(self, arrival_time: float, n: int = 1, max_tokens: int | None = None):
        """`n`: the request's; `max_tokens`: the engine's, after it filled an unset one with
        the room beside the prompt (RequestStream.accepted sets it); observed at the end."""
        self.arrival_time = arrival_time
        self.n = n
        self.max_tokens = max_tokens
        self.num_prompt_tokens = 0
        self._metrics: RequestMetrics | None = None  # the core's stamps, latest output's
        self._samples = [_SampleTimes() for _ in range(n)]

    def observe(self, delta: RequestOutput, now: float, stats: IterationStats) -> None:
        """`delta` is a DELTA output (only new tokens) that arrived at `now`."""
        if delta.prompt_token_ids:
            self.num_prompt_tokens = len(delta.prompt_token_ids)
        self._metrics = delta.metrics or self._metrics
        if getattr(delta, "pooled", None) is not None:
            self._observe_pooled(now, stats)
        for out in delta.outputs:
            sample = self._samples[out.index]
            if out.token_ids:
                self._observe_tokens(sample, len(out.token_ids), now, stats)
            if out.finish_reason and not sample.finished:
                sample.finished = True
                self._observe_finished(out.index, finished_reason(out), now, stats)
        if delta.finished:
            stats.request_params_n.append(self.n)
            stats.request_max_generation_tokens.append(max(s.num_tokens for s in self._samples))

    def observe_abort(self, now: float, stats: IterationStats) -> None:
        """The caller aborted the request: each sample still running ends as an abort (its
        latency only, as nothing more of it is known)."""
        for sample in self._samples:
            if not sample.finished:
                sample.finished = True
                stats.finished_reasons.append("abort")
                stats.e2e_latencies.append(now - self.arrival_time)

    def _observe_pooled(self, now: float, stats: IterationStats) -> None:
        """A pooling request's one output ends its prefill with no token: its prompt counts
        and its latency is a first token's, as vLLM's first (is_prefilling) output of any
        request; else prompt_tokens_total stayed 0 on a pooling server."""
        sample = self._samples[0]
        if sample.first_token is None:
            sample.first_token = sample.last_token = now
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.time_to_first_tokens.append(now - self.arrival_time)

    def _observe_tokens(self, sample: _SampleTimes, count: int, now: float,
                        stats: IterationStats) -> None:
        stats.num_generation_tokens += count
        if sample.first_token is None:  # this sample's prefill ended
            sample.first_token = now
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.time_to_first_tokens.append(now - self.arrival_time)
        else:
            stats.inter_token_latencies.append(now - sample.last_token)
        # Tokens of several core steps that arrive in one delta (the front end caught up)
        # reach the client together: one sample per token, as a streaming client times them.
        stats.inter_token_latencies.extend([0.0] * (count - 1))
        sample.last_token = now
        sample.num_tokens += count

    def _observe_finished(self, index: int, reason: str, now: float,
                          stats: IterationStats) -> None:
        sample = self._samples[index]
        stats.e2e_latencies.append(now - self.arrival_time)
        stats.finished_reasons.append(reason)
        stats.request_prompt_tokens.append(self.num_prompt_tokens)
        stats.request_generation_tokens.append(sample.num_tokens)
        if self.max_tokens is not None:
            stats.request_params_max_tokens.append(self.max_tokens)
        if sample.first_token is None:
            return
        stats.request_decode_times.append(sample.last_token - sample.first_token)
        # Phases: none for an abort or an error, or for a sample never scheduled (nothing to
        # measure from).
        scheduled = self._first_scheduled(index)
        if reason in ("abort", "error") or scheduled is None:
            return
        stats.request_queue_times.append(scheduled - self.arrival_time)
        stats.request_prefill_times.append(sample.first_token - scheduled)
        stats.request_inference_times.append(sample.last_token - scheduled)

    def _first_scheduled(self, index: int) -> float | None:
        metrics = self._metrics
        if metrics is None:
            return None
        per_sample = metrics.sample_first_scheduled_times
        return per_sample[index] if index < len(per_sample) else metrics.first_scheduled_time


class LoggingStatLogger:
    """The periodic log line: throughput, running / waiting, KV cache usage, prefix hit rate
    (and vLLM's SpecDecoding line after it, where the window ran drafts).

    A line every `interval` s while the engine is busy, and one when it drains (so the last line
    says it is idle); nothing while idle. A busy period's first window starts when its first
    request arrived, so an idle gap never dilutes the throughput shown after it. Never two lines
    within `interval` s: back-to-back requests each drain the engine, and a line per request
    flooded the log (vLLM logs one per interval); a drain too soon after the last line is logged
    `interval` s after it, unless a request came meanwhile.
    """

    def __init__(self, interval: float = 5.0, clock=None, emit=None, schedule=None):
        """`schedule(delay, fn)`: run `fn` on this thread `delay` s later, False where it cannot
        (default: the running event loop's call_later; without one a drain logs at once)."""
        import time

        from kiln.logger import init_logger

        self.interval = interval
        self._clock = clock or time.monotonic
        self._emit = emit or init_logger(__name__).info
        self._idle = True
        self._first_window = False
        self._start = 0.0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix = (0, 0)  # (queries, hits) totals when the window started
        self._spec: tuple | None = None  # spec-decode totals then (None: since start)
        self._schedule = schedule or _call_later
        self._last_line = float("-inf")
        self._drained: tuple[float, dict] | None = None  # a drain not logged yet: (when, stats)
        self._flush_set = False  # flush is scheduled
        self._engine_stats: dict = {}  # the latest recorded

    def record(self, iteration: IterationStats, engine_stats: dict) -> None:
        now = self._clock()
        self._engine_stats = engine_stats
        busy = engine_stats.get("num_running", 0) + engine_stats.get("num_waiting", 0) > 0
        tokens = iteration.num_prompt_tokens + iteration.num_generation_tokens
        if self._idle:
            if not (busy or tokens):
                return
            self._idle, self._first_window, self._start = False, True, now
        if self._first_window and iteration.time_to_first_tokens:
            self._start = min(self._start, now - max(iteration.time_to_first_tokens))
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        if busy:
            self._drained = None  # busy again before its line: this window goes on
            if now - self._start >= self.interval:
                self._log(now, engine_stats)
            return
        wait = self._last_line + self.interval - now
        if wait > 0 and (self._flush_set or self._schedule(wait, self.flush)):
            self._flush_set = True
            self._drained = (now, engine_stats)
            return
        self._log(now, engine_stats)
        self._drained, self._idle = None, True  # a flush still due finds nothing to log

    def flush(self, stopped: bool = False) -> None:
        """Log a drain still waiting for its time. `stopped`: the engine has stopped, its
        requests aborted (the server calls it so as it stops): a window still open is logged
        as drained too. Aborts are recorded with the engine's stats of the step before them
        and no step follows a shutdown, so the log's last line said requests were running."""
        self._flush_set = False
        if self._drained is None and stopped and not self._idle:
            self._drained = (self._clock(), {**self._engine_stats, "num_running": 0,
                                             "num_waiting": 0, "kv_cache_usage": 0.0})
        if self._drained is not None:
            self._log(*self._drained)
            self._drained, self._idle = None, True

    def _log(self, now: float, engine_stats: dict) -> None:
        elapsed = now - self._start
        queries = engine_stats.get("prefix_cache_queries", 0)
        hits = engine_stats.get("prefix_cache_hits", 0)
        d_queries, d_hits = queries - self._prefix[0], hits - self._prefix[1]
        self._emit(format_stats_line(
            self._prompt_tokens / elapsed if elapsed > 0 else 0.0,
            self._generation_tokens / elapsed if elapsed > 0 else 0.0,
            engine_stats, d_hits / d_queries if d_queries > 0 else 0.0))
        spec = spec_totals(engine_stats)
        spec_line = spec_decoding_line(spec, self._spec, elapsed)
        if spec_line is not None:
            self._emit(spec_line)
        self._start, self._first_window, self._last_line = now, False, now
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix, self._spec = (queries, hits), spec


def _call_later(delay: float, fn) -> bool:
    import asyncio

    try:
        asyncio.get_running_loop().call_later(delay, fn)
    except RuntimeError:  # no event loop in this thread
        return False
    return True


def format_stats_line(prompt_tps: float, generation_tps: float, engine_stats: dict,
                      prefix_hit_rate: float) -> str:
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {engine_stats.get('num_running', 0)} reqs, "
            f"Waiting: {engine_stats.get('num_waiting', 0)} reqs, "
            f"KV cache usage: {100 * engine_stats.get('kv_cache_usage', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * prefix_hit_rate:.1f}%")
