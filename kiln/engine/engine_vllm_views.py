"""`EngineVllmViews`: the config attributes and methods vLLM's LLMEngine has that scripts read
(RL trainers, eval harnesses: `llm.llm_engine.vllm_config.cache_config.block_size`), as read-only
views over the engine's KilnConfig, whose sub-configs carry vLLM's names: no second copy.
"""
import time


class EngineVllmViews:
    """Mixed into `LLMEngine` (llm_engine.py), whose `kiln_config` these read."""

    @property
    def vllm_config(self):
        """vLLM's VllmConfig: the KilnConfig (model_config, cache_config, scheduler_config,
        parallel_config, load_config, device_config, compilation_config, as vLLM names them)."""
        return self.kiln_config

    @property
    def cache_config(self):
        return self.kiln_config.cache_config

    @property
    def scheduler_config(self):
        return self.kiln_config.scheduler_config

    @property
    def parallel_config(self):
        return self.kiln_config.parallel_config

    def get_vllm_config(self):
        return self.kiln_config

    def get_model_config(self):
        return self.kiln_config.model_config

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's tasks this engine runs: its runner's (generate; embed for --runner pooling;
        classify, and score for a one-label classifier, for a classification model)."""
        from kiln.pooling.pooling_task import num_labels

        model_config = self.kiln_config.model_config
        if model_config.runner_type != "pooling":
            return ("generate",)
        if model_config.pooler_config.task == "embed":
            return ("embed", "encode")
        one = num_labels(model_config.hf_config) == 1
        return ("classify", "score", "encode") if one else ("classify", "encode")

    def do_log_stats(self) -> None:
        """vLLM's: one stats line (throughput since the last call, running / waiting, KV cache
        usage, prefix hit rate), the line kiln serve logs while busy; and the SpecDecoding line
        after it where speculation drafted since the last call."""
        from kiln.engine.request_stats import format_stats_line
        from kiln.logger import init_logger
        from kiln.spec_decode.stats_log import spec_decoding_line, spec_totals

        stats, now = self.get_stats(), time.monotonic()
        since, prompt, generation, queries, hits, spec = self._last_logged
        elapsed = now - since
        d_queries = stats["prefix_cache_queries"] - queries
        log = init_logger(__name__).info
        log(format_stats_line(
            (stats["prompt_tokens_total"] - prompt) / elapsed if elapsed > 0 else 0.0,
            (stats["generation_tokens_total"] - generation) / elapsed if elapsed > 0 else 0.0,
            stats, (stats["prefix_cache_hits"] - hits) / d_queries if d_queries > 0 else 0.0))
        spec_now = spec_totals(stats)
        spec_line = spec_decoding_line(spec_now, spec, elapsed)
        if spec_line is not None:
            log(spec_line)
        self._last_logged = (now, stats["prompt_tokens_total"], stats["generation_tokens_total"],
                             stats["prefix_cache_queries"], stats["prefix_cache_hits"], spec_now)
