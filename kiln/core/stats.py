"""`SchedulerStats`: a snapshot of the scheduler and KV cache, for logging and metrics.

Counters (prefix cache, preemptions) are totals since the engine started.
"""
from dataclasses import asdict, dataclass, field


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
    # speculative decoding (vLLM's spec_decode counters; 0 without --speculative-config)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # vLLM's lora_requests_info: the adapters (names) of running / waiting requests
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def spec_decode_stats(spec_decode) -> dict:
    """SchedulerStats' spec_decode_* fields from the scheduler's SpecDecodeScheduling (None:
    no speculative decoding)."""
    if spec_decode is None:
        return {}
    s = spec_decode.stats
    return {"spec_decode_num_drafts": s.num_drafts,
            "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(s.num_accepted_tokens_per_pos)}
