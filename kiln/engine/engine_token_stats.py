"""`EngineTokenStats`: LLMEngine's token totals, counted as the server's metrics count them,
and the stats it reports (the scheduler's, with those totals).
"""


class EngineTokenStats:
    """Mixed into `LLMEngine` (llm_engine.py), whose state and helpers these methods use."""

    def _count_tokens(self, steps: list[list], seen: list[tuple[int, int] | None],
                      engines: list[int]) -> list[tuple[int, int]]:
        """Add up what core steps' outputs (one list per step) showed the user: `seen`, the
        output processor's (prompt, generated) tokens per output in the steps' order (None:
        never shown); `engines`: each step's data-parallel replica. Returns (replica, prompt +
        generated tokens) of each step, for every step with an
        output the user sees (as vLLM observes iteration tokens: a step of a partial prefill
        sends none; nor does one that only finished requests aborted meanwhile count here).
        Generated tokens are those the output kept: a stop string inside a run of accepted
        drafts cuts the rest, which no step without drafts would have made."""
        totals, i = [], 0
        for outputs, engine in zip(steps, engines):
            counted = [c for c in seen[i:i + len(outputs)] if c is not None]
            i += len(outputs)
            if not counted:
                continue
            prompt = sum(p for p, _ in counted)
            generated = sum(g for _, g in counted)
            self.num_prompt_tokens += prompt
            self.num_generation_tokens += generated
            totals.append((engine, prompt + generated))
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
