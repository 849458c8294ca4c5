"""`EngineTokenStats`: LLMEngine's token totals, counted as the server's metrics count them,
and the stats it reports (the scheduler's, with those totals).
"""


class EngineTokenStats:
    """Mixed into `LLMEngine` (llm_engine.py), whose state and helpers these methods use."""

    def _count_tokens(self, steps: list[list]) -> list[int]:
        """Count the tokens of core steps' outputs (one list per step) before the output
        processor sees them; returns each step's prompt + generated tokens, for every step with
        an output the user sees (as vLLM observes iteration tokens: a step of a partial prefill
        sends none; nor does one that only finished requests aborted meanwhile count here).
        A sample with no tokens yet is prefilled now. One batch can hold several steps' outputs
        of a sample (the core ran ahead of this loop), all before the output processor has given
        it any token: its prompt counts once, in its first step."""
        prefilled = set()
        totals = []
        for outputs in steps:
            seen, tokens = False, 0
            for out in outputs:
                entry = self.output_processor.samples.get(out.request_id)
                if entry is None or entry[1].finished:
                    # Aborted, or ended by a stop string (the output processor drops its late
                    # tokens too): the user never sees these.
                    continue
                seen = True
                state, sample = entry
                if getattr(out, "pooling_output", None) is not None:
                    # a pooling request's prefill ends with its vector, no token (vLLM counts
                    # its prompt all the same)
                    self.num_prompt_tokens += len(state.prompt_token_ids)
                    tokens += len(state.prompt_token_ids)
                    continue
                if not out.new_token_ids:
                    continue
                if not sample.token_ids and out.request_id not in prefilled:
                    prefilled.add(out.request_id)
                    self.num_prompt_tokens += len(state.prompt_token_ids)
                    tokens += len(state.prompt_token_ids)
                self.num_generation_tokens += len(out.new_token_ids)
                tokens += len(out.new_token_ids)
            if seen:
                totals.append(tokens)
        return totals

    def get_stats(self) -> dict:
        """Fresh stats: they show every abort and add made before this call."""
        return self._stats(self._core().make_stats())

    def step_stats(self) -> dict:
        """The stats as of the last step (no round trip to a core process)."""
        return self._stats(self._core().step_stats())

    def _stats(self, scheduler_stats) -> dict:
        stats = scheduler_stats.to_dict()
        stats.update(prompt_tokens_total=self.num_prompt_tokens,
                     generation_tokens_total=self.num_generation_tokens,
                     num_unfinished_requests=self.get_num_unfinished_requests())
        return stats
