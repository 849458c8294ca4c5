"""Prometheus metrics for GET /metrics, all named `kiln:*` and labelled with the model name.

A `StatLogger` for AsyncLLM: token counters and latency histograms per step, gauges from the
engine's stats (refreshed again on every scrape).
"""
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from kiln.engine.request_stats import IterationStats

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0]

# get_stats() key -> (gauge name, help)
_GAUGES = {
    "num_running": ("kiln:num_requests_running", "Requests in the running batch"),
    "num_waiting": ("kiln:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("kiln:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)"),
    "num_free_blocks": ("kiln:kv_cache_free_blocks", "KV cache blocks free"),
    "num_total_blocks": ("kiln:kv_cache_total_blocks", "KV cache blocks in all"),
}


class ServerMetrics:
    """Owns its registry, so several servers (or tests) in one process do not collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self._label = {"model_name": model_name}
        self.gauges = {key: Gauge(name, doc, labels, registry=reg).labels(**self._label)
                       for key, (name, doc) in _GAUGES.items()}
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prefilled prompt tokens", labels,
                                     registry=reg).labels(**self._label)
        self.generation_tokens = Counter("kiln:generation_tokens", "Generated tokens", labels,
                                         registry=reg).labels(**self._label)
        self.request_success = Counter("kiln:request_success", "Finished requests by reason",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=reg
                              ).labels(**self._label)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg
                             ).labels(**self._label)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Arrival to last output",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(**self._label)

    def record(self, iteration: IterationStats, engine_stats: dict) -> None:
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        for t in iteration.time_to_first_tokens:
            self.ttft.observe(t)
        for t in iteration.inter_token_latencies:
            self.itl.observe(t)
        for t in iteration.e2e_latencies:
            self.e2e.observe(t)
        for reason in iteration.finished_reasons:
            self.request_success.labels(finished_reason=reason, **self._label).inc()
        self.update_gauges(engine_stats)

    def update_gauges(self, engine_stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in engine_stats:
                gauge.set(float(engine_stats[key]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
