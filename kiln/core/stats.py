"""`SchedulerStats`: a snapshot of the scheduler and KV cache, for logging and metrics.

Counters (prefix cache, preemptions) are totals since the engine started.
"""
from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by live requests, in [0, 1]
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
