"""Per-request latency and token bookkeeping (TTFT, inter-token latency, phases, sizes) for stat
loggers.

`AsyncLLM` fills one `IterationStats` per engine step and hands it to every `StatLogger`.
Token counts follow vLLM: each of a request's n samples prefills the prompt, so its prompt
counts once per sample, when that sample's first token arrives; a request finishes once.
Phases follow vLLM v1, from the core's first-scheduled time (a preemption does not reset it):
queue = arrival -> first scheduled, prefill = first scheduled -> first token, inference = first
scheduled -> last token; so queue + prefill = TTFT and inference = prefill + decode.
"""
from dataclasses import dataclass, field
from typing import Protocol

from kiln.outputs import RequestOutput


@dataclass
class IterationStats:
    # Prompt + generated tokens of each engine core step with outputs that this batch took in
    # (the engine's last_step_tokens): none for a poll that found no step, or an abort.
    step_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt once per sample that produced its first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, per request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, per sample
    # Finished requests (user requests, not samples): one entry each, in the same order.
    e2e_latencies: list[float] = field(default_factory=list)  # seconds
    finished_reasons: list[str] = field(default_factory=list)
    request_prompt_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_generation_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_max_generation_tokens: list[int] = field(default_factory=list)  # longest sample's
    request_params_n: list[int] = field(default_factory=list)
    request_params_max_tokens: list[int] = field(default_factory=list)  # where one was set
    request_decode_times: list[float] = field(default_factory=list)  # first -> last token
    # Finished requests that were scheduled and produced a token, not aborted ones (as vLLM).
    request_queue_times: list[float] = field(default_factory=list)  # arrival -> scheduled
    request_prefill_times: list[float] = field(default_factory=list)  # scheduled -> first token
    request_inference_times: list[float] = field(default_factory=list)  # scheduled -> last token


class StatLogger(Protocol):
    def record(self, iteration: IterationStats, engine_stats: dict) -> None: ...


class RequestTimer:
    """Times one request's outputs; writes what it saw this step into an IterationStats."""

    def __init__(self, arrival_time: float, n: int = 1, max_tokens: int | None = None):
        """`n`, `max_tokens`: the request's sampling parameters, observed when it finishes."""
        self.arrival_time = arrival_time
        self.n = n
        self.max_tokens = max_tokens
        self.first_token_time: float | None = None  # of the request (any sample)
        self.last_token_time: float | None = None
        self.first_scheduled_time: float | None = None  # from the core, via RequestOutput.metrics
        self._sample_last_token: dict[int, float] = {}  # by sample index
        self._sample_tokens: dict[int, int] = {}  # generated tokens, by sample index
        self._finish_reasons: dict[int, str] = {}
        self.num_prompt_tokens = 0

    def observe(self, delta: RequestOutput, new_tokens: int, now: float,
                stats: IterationStats) -> None:
        """`delta` is a DELTA output (only new tokens); `new_tokens` is their total."""
        prompt_len = len(delta.prompt_token_ids or [])
        scheduled = delta.metrics.first_scheduled_time if delta.metrics is not None else None
        if scheduled is not None and (self.first_scheduled_time is None
                                      or scheduled < self.first_scheduled_time):
            self.first_scheduled_time = scheduled
        for out in delta.outputs:
            if out.finish_reason:
                self._finish_reasons[out.index] = out.finish_reason
            if not out.token_ids:
                continue
            self._sample_tokens[out.index] = self._sample_tokens.get(out.index, 0) + \
                len(out.token_ids)
            stats.num_generation_tokens += len(out.token_ids)
            last = self._sample_last_token.get(out.index)
            if last is None:  # this sample's prefill ended
                stats.num_prompt_tokens += prompt_len
                self.num_prompt_tokens = prompt_len
            else:
                stats.inter_token_latencies.append(now - last)
            # Tokens of several core steps that arrive in one delta (the front end caught up)
            # reach the client together: one sample per token, as a streaming client times them.
            if len(out.token_ids) > 1:
                stats.inter_token_latencies.extend([0.0] * (len(out.token_ids) - 1))
            self._sample_last_token[out.index] = now
        if new_tokens > 0:
            if self.first_token_time is None:
                self.first_token_time = now
                stats.time_to_first_tokens.append(now - self.arrival_time)
            self.last_token_time = now
        if delta.finished:
            stats.e2e_latencies.append(now - self.arrival_time)
            # The request's reason is its first sample's, whichever sample ended last.
            reason = self._finish_reasons[min(self._finish_reasons)] \
                if self._finish_reasons else "stop"
            stats.finished_reasons.append(reason)
            stats.request_prompt_tokens.append(self.num_prompt_tokens or prompt_len)
            stats.request_generation_tokens.append(sum(self._sample_tokens.values()))
            stats.request_max_generation_tokens.append(max(self._sample_tokens.values(),
                                                           default=0))
            stats.request_params_n.append(self.n)
            if self.max_tokens is not None:
                stats.request_params_max_tokens.append(self.max_tokens)
            if self.first_token_time is not None:
                stats.request_decode_times.append(self.last_token_time - self.first_token_time)
            self._record_phases(reason, stats)

    def _record_phases(self, reason: str, stats: IterationStats) -> None:
        """Queue / prefill / inference of a finished request; none for an abort, or for a
        request never scheduled or without a token (nothing to measure them to)."""
        scheduled = self.first_scheduled_time
        if reason == "abort" or scheduled is None or self.first_token_time is None:
            return
        stats.request_queue_times.append(scheduled - self.arrival_time)
        stats.request_prefill_times.append(self.first_token_time - scheduled)
        stats.request_inference_times.append(self.last_token_time - scheduled)


class LoggingStatLogger:
    """The periodic log line: throughput, running / waiting, KV cache usage, prefix hit rate.

    A line every `interval` s while the engine is busy, and one when it drains (so the last line
    says it is idle); nothing while idle. A busy period's first window starts when its first
    request arrived, so an idle gap never dilutes the throughput shown after it.
    """

    def __init__(self, interval: float = 5.0, clock=None, emit=None):
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

    def record(self, iteration: IterationStats, engine_stats: dict) -> None:
        now = self._clock()
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
        if not busy:
            self._log(now, engine_stats)
            self._idle = True
        elif now - self._start >= self.interval:
            self._log(now, engine_stats)

    def _log(self, now: float, engine_stats: dict) -> None:
        elapsed = now - self._start
        queries = engine_stats.get("prefix_cache_queries", 0)
        hits = engine_stats.get("prefix_cache_hits", 0)
        d_queries, d_hits = queries - self._prefix[0], hits - self._prefix[1]
        self._emit(format_stats_line(
            self._prompt_tokens / elapsed if elapsed > 0 else 0.0,
            self._generation_tokens / elapsed if elapsed > 0 else 0.0,
            engine_stats, d_hits / d_queries if d_queries > 0 else 0.0))
        self._start, self._first_window = now, False
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix = (queries, hits)


def format_stats_line(prompt_tps: float, generation_tps: float, engine_stats: dict,
                      prefix_hit_rate: float) -> str:
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {engine_stats.get('num_running', 0)} reqs, "
            f"Waiting: {engine_stats.get('num_waiting', 0)} reqs, "
            f"KV cache usage: {100 * engine_stats.get('kv_cache_usage', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * prefix_hit_rate:.1f}%")
