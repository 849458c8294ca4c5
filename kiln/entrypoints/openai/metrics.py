"""Prometheus metrics for GET /metrics, all named `kiln:*` and labelled with the model name
(and, as vLLM's, the engine's: the data-parallel replica that served or holds it).

A `StatLogger` for AsyncLLM: token counters and latency histograms per step, gauges and
engine-total counters from the engine's stats (refreshed again on every scrape). Names and types
are vLLM's with `kiln:` for `vllm:`, so a vLLM dashboard ports by renaming. It also feeds the
server's periodic stats log line.
"""
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kiln.engine.request_stats import IterationStats, LoggingStatLogger

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0]
# 1, 2, 5, 10, 20, 50, ... tokens: request sizes from one token to a million.
_TOKEN_BUCKETS = [m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000]
# Tokens of one engine step: 1 to max_num_batched_tokens.
_STEP_BUCKETS = [2 ** e for e in range(17)]
_N_BUCKETS = [1, 2, 5, 10, 20]
# Every finish reason the engine gives, so each series exists (at 0) before its first request.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# get_stats() key -> (gauge name, help)
_GAUGES = {
    "num_running": ("kiln:num_requests_running", "Requests in the running batch"),
    "num_waiting": ("kiln:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("kiln:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)"),
    "num_free_blocks": ("kiln:kv_cache_free_blocks", "KV cache blocks free"),
    "num_total_blocks": ("kiln:kv_cache_total_blocks", "KV cache blocks in all"),
}
# get_stats() key of a total since the engine started -> (counter name, help)
_TOTALS = {
    "prefix_cache_queries": ("kiln:prefix_cache_queries", "Prompt tokens looked up in the "
                             "prefix cache"),
    "prefix_cache_hits": ("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("kiln:num_preemptions", "Requests preempted (to be recomputed)"),
    # vLLM's vllm:spec_decode_* (speculative decoding; 0 without --speculative-config)
    "spec_decode_num_drafts": ("kiln:spec_decode_num_drafts", "Request steps that ran drafts"),
    "spec_decode_num_draft_tokens": ("kiln:spec_decode_num_draft_tokens", "Draft tokens run"),
    "spec_decode_num_accepted_tokens": ("kiln:spec_decode_num_accepted_tokens", "Draft tokens "
                                        "accepted"),
}

# IterationStats field -> (histogram name, help, buckets). "Finished requests" are samples, as
# vLLM's child requests: a request of n observes n (request_params_n and
# request_max_num_generation_tokens: once). Phases (queue, prefill, inference) are from the
# sample's first scheduling by the core; aborts observe none.
_HISTOGRAMS = {
    "time_to_first_tokens": ("kiln:time_to_first_token_seconds", "Time to first token",
                             _LATENCY_BUCKETS),
    "inter_token_latencies": ("kiln:inter_token_latency_seconds", "Time between output tokens",
                              _LATENCY_BUCKETS),
    "e2e_latencies": ("kiln:e2e_request_latency_seconds", "Arrival to last output",
                      _E2E_BUCKETS),
    "request_prompt_tokens": ("kiln:request_prompt_tokens", "Prompt tokens of finished "
                              "requests", _TOKEN_BUCKETS),
    "request_generation_tokens": ("kiln:request_generation_tokens", "Generated tokens of "
                                  "finished requests (each sample's own)", _TOKEN_BUCKETS),
    "request_max_generation_tokens": ("kiln:request_max_num_generation_tokens", "Generated "
                                      "tokens of the longest sample of finished requests",
                                      _TOKEN_BUCKETS),
    "request_params_n": ("kiln:request_params_n", "The n of finished requests", _N_BUCKETS),
    "request_params_max_tokens": ("kiln:request_params_max_tokens", "The max_tokens of "
                                  "finished requests", _TOKEN_BUCKETS),
    "request_decode_times": ("kiln:request_decode_time_seconds", "First to last token of "
                             "finished requests", _E2E_BUCKETS),
    "request_queue_times": ("kiln:request_queue_time_seconds", "Arrival to first scheduled, "
                            "of finished requests", _E2E_BUCKETS),
    "request_prefill_times": ("kiln:request_prefill_time_seconds", "First scheduled to first "
                              "token, of finished requests", _E2E_BUCKETS),
    "request_inference_times": ("kiln:request_inference_time_seconds", "First scheduled to "
                                "last token, of finished requests", _E2E_BUCKETS),
    "step_tokens": ("kiln:iteration_tokens_total", "Prompt and generated tokens of each engine "
                    "step with outputs", _STEP_BUCKETS),
}


class ServerMetrics:
    """Owns its registry, so several servers (or tests) in one process do not collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, log_interval: float | None = 5.0,
                 cache_info: dict | None = None, max_lora: int | None = None,
                 num_engines: int = 1):
        """`log_interval`: seconds between stats log lines while busy; None: no log lines.
        `cache_info`: the KV cache's settings, exposed as kiln:cache_config_info labels.
        `max_lora`: --max-loras under --enable-lora (kiln:lora_requests_info); None: off.
        `num_engines`: --data-parallel-size (each replica's series exist from the start)."""
        self.stats_log = LoggingStatLogger(log_interval) if log_interval else None
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        # The server process's own series (process_resident_memory_bytes, process_open_fds,
        # python_gc_*), as vLLM's /metrics has from prometheus_client's default registry:
        # dashboards and leak alerts read them.
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self._label = {"model_name": model_name}

        # Every series is per data-parallel replica, as vLLM's (engine="0", "1", ...): a
        # request's latencies, tokens and finish under the replica that served it.
        engine_labels = labels + ["engine"]
        engines = [str(i) for i in range(max(1, num_engines))]
        self.gauges = {key: Gauge(name, doc, engine_labels, registry=reg)
                       for key, (name, doc) in _GAUGES.items()}
        self.totals = {key: Counter(name, doc, engine_labels, registry=reg)
                       for key, (name, doc) in _TOTALS.items()}
        # Engine totals already counted, by (engine, key): stats can arrive out of order (a
        # stale snapshot after a fresh scrape), so a counter only moves up to the largest seen.
        self._seen_totals: dict[tuple[str, str], int] = {}
        # vLLM's vllm:spec_decode_num_accepted_tokens_per_pos, by draft position (0-based)
        self.accepted_per_pos = Counter("kiln:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position",
                                        engine_labels + ["position"], registry=reg)
        self._seen_per_pos: dict[tuple[str, int], int] = {}
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prefilled prompt tokens",
                                     engine_labels, registry=reg)
        self.generation_tokens = Counter("kiln:generation_tokens", "Generated tokens",
                                         engine_labels, registry=reg)
        self.request_success = Counter("kiln:request_success", "Finished requests by reason",
                                       engine_labels + ["finished_reason"], registry=reg)
        # One observation per value of the IterationStats field each is keyed by.
        self.histograms = {field: Histogram(name, doc, engine_labels, buckets=buckets,
                                            registry=reg)
                           for field, (name, doc, buckets) in _HISTOGRAMS.items()}
        for engine in engines:  # there before the first stats and the first request
            for family in (*self.gauges.values(), *self.totals.values(), self.prompt_tokens,
                           self.generation_tokens, *self.histograms.values()):
                family.labels(engine=engine, **self._label)
            for reason in FINISH_REASONS:
                self.request_success.labels(finished_reason=reason, engine=engine,
                                            **self._label)
        # vLLM's vllm:lora_requests_info: the adapters in use as labels, the time they were
        # seen as the value (readers take the newest series); only the current series is kept
        self.lora_info = None if max_lora is None else Gauge(
            "kiln:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
        self._max_lora, self._lora_labels = str(max_lora), None
        if cache_info:
            Gauge("kiln:cache_config_info", "The KV cache's settings", sorted(cache_info),
                  registry=reg).labels(**{k: str(v) for k, v in cache_info.items()}).set(1)

    def record(self, iteration: IterationStats, engine_stats: dict) -> None:
        label = {"engine": str(iteration.engine), **self._label}
        if iteration.num_prompt_tokens:
            self.prompt_tokens.labels(**label).inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.labels(**label).inc(iteration.num_generation_tokens)
        for field, family in self.histograms.items():
            values = getattr(iteration, field)
            if values:
                hist = family.labels(**label)
                for v in values:
                    hist.observe(v)
        for reason in iteration.finished_reasons:
            self.request_success.labels(finished_reason=reason, **label).inc()
        self.update_gauges(engine_stats)
        if self.stats_log is not None:
            self.stats_log.record(iteration, engine_stats)

    def update_gauges(self, engine_stats: dict) -> None:
        """Gauges from an engine stats snapshot, and counters from its totals: per replica
        where it has them (`engines`, data parallel), else as engine "0"."""
        per_engine = engine_stats.get("engines") or [engine_stats]
        for index, stats in enumerate(per_engine):
            self._update_engine(str(index), stats)
        if self.lora_info is not None and "running_lora_adapters" in engine_stats:
            self._set_lora_info(engine_stats)

    def _update_engine(self, engine: str, stats: dict) -> None:
        label = {"engine": engine, **self._label}
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.labels(**label).set(float(stats[key]))
        for key, counter in self.totals.items():
            total, seen = stats.get(key), self._seen_totals.get((engine, key), 0)
            if total is not None and total > seen:
                counter.labels(**label).inc(total - seen)
                self._seen_totals[engine, key] = total
        for pos, total in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            seen = self._seen_per_pos.get((engine, pos), 0)
            if total > seen:
                self.accepted_per_pos.labels(position=str(pos), **label).inc(total - seen)
                self._seen_per_pos[engine, pos] = total

    def _set_lora_info(self, engine_stats: dict) -> None:
        labels = (self._max_lora, ",".join(engine_stats["waiting_lora_adapters"]),
                  ",".join(engine_stats["running_lora_adapters"]))
        if self._lora_labels not in (None, labels):
            self.lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
