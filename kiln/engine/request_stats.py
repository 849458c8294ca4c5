"""Per-request latency bookkeeping (time to first token, inter-token latency) for stat loggers.

`AsyncLLM` fills one `IterationStats` per engine step and hands it to every `StatLogger`.
"""
from dataclasses import dataclass, field
from typing import Protocol

from kiln.outputs import RequestOutput


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds
    e2e_latencies: list[float] = field(default_factory=list)  # seconds, finished requests
    finished_reasons: list[str] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, iteration: IterationStats, engine_stats: dict) -> None: ...


class RequestTimer:
    """Times one request's outputs; writes what it saw this step into an IterationStats."""

    def __init__(self, arrival_time: float):
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def observe(self, delta: RequestOutput, new_tokens: int, now: float,
                stats: IterationStats) -> None:
        if new_tokens > 0:
            stats.num_generation_tokens += new_tokens
            if self.first_token_time is None:
                self.first_token_time = now
                stats.num_prompt_tokens += len(delta.prompt_token_ids or [])
                stats.time_to_first_tokens.append(now - self.arrival_time)
            else:
                stats.inter_token_latencies.append(now - self.last_token_time)
            self.last_token_time = now
        if delta.finished:
            stats.e2e_latencies.append(now - self.arrival_time)
            reasons = [o.finish_reason for o in delta.outputs if o.finish_reason]
            stats.finished_reasons.append(reasons[0] if reasons else "stop")
