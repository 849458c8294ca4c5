"""Per-request latency and token bookkeeping (TTFT, inter-token latency, sizes) for stat loggers.

`AsyncLLM` fills one `IterationStats` per engine step and hands it to every `StatLogger`.
Token counts follow vLLM: each of a request's n samples prefills the prompt, so its prompt
counts once per sample, when that sample's first token arrives; a request finishes once.
"""
from dataclasses import dataclass, field
from typing import Protocol

from kiln.outputs import RequestOutput


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # prompt once per sample that produced its first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, per request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, per sample
    # Finished requests (user requests, not samples): one entry each, in the same order.
    e2e_latencies: list[float] = field(default_factory=list)  # seconds
    finished_reasons: list[str] = field(default_factory=list)
    request_prompt_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_generation_tokens: list[int] = field(default_factory=list)  # not for aborts
    request_decode_times: list[float] = field(default_factory=list)  # first -> last token


class StatLogger(Protocol):
    def record(self, iteration: IterationStats, engine_stats: dict) -> None: ...


class RequestTimer:
    """Times one request's outputs; writes what it saw this step into an IterationStats."""

    def __init__(self, arrival_time: float):
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None  # of the request (any sample)
        self.last_token_time: float | None = None
        self._sample_last_token: dict[int, float] = {}  # by sample index
        self._finish_reasons: dict[int, str] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def observe(self, delta: RequestOutput, new_tokens: int, now: float,
                stats: IterationStats) -> None:
        """`delta` is a DELTA output (only new tokens); `new_tokens` is their total."""
        prompt_len = len(delta.prompt_token_ids or [])
        for out in delta.outputs:
            if out.finish_reason:
                self._finish_reasons[out.index] = out.finish_reason
            if not out.token_ids:
                continue
            self.num_generation_tokens += len(out.token_ids)
            stats.num_generation_tokens += len(out.token_ids)
            last = self._sample_last_token.get(out.index)
            if last is None:  # this sample's prefill ended
                stats.num_prompt_tokens += prompt_len
                self.num_prompt_tokens = prompt_len
            else:
                stats.inter_token_latencies.append(now - last)
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
            stats.request_generation_tokens.append(self.num_generation_tokens)
            if self.first_token_time is not None:
                stats.request_decode_times.append(self.last_token_time - self.first_token_time)
