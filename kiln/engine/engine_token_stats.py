"""`EngineTokenStats`: LLMEngine's token totals, counted as the server's metrics count them,
and the stats it reports (the scheduler's, with those totals); `StepTokens`, one core step's.
"""
from dataclasses import dataclass, field


@dataclass
class StepTokens:
    """One core step with outputs the user saw (vLLM's iteration_tokens_total observes one value
    per such step): its data-parallel replica (0 without data parallel) and the prompt +
    generated tokens each user request showed from it. Kept per request: the front end drops
    the outputs of a request aborted while the step ran, and their tokens with them."""
    engine: int = 0
    by_request: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(self.by_request.values())

    def kept(self, request_ids) -> "StepTokens | None":
        """The step as seen through the requests in `request_ids` only; None if it showed
        none of them."""
        by_request = {rid: n for rid, n in self.by_request.items() if rid in request_ids}
        return StepTokens(self.engine, by_request) if by_request else None


class EngineTokenStats:
    """Mixed into `LLMEngine` (llm_engine.py), whose state and helpers these methods use."""

    def _count_tokens(self, steps: list[list], seen: list[tuple[str, int, int] | None],
                      engines: list[int]) -> list[StepTokens]:
        """Add up what core steps' outputs (one list per step) showed the user: `seen`, the
        output processor's (user request id, prompt, generated tokens) per output in the steps'
        order (None: never shown); `engines`: each step's data-parallel replica. Returns the
        StepTokens of every step with an output the user sees (as vLLM observes iteration
        tokens: a step of a partial prefill sends none; nor does one that only finished
        requests aborted meanwhile count here).
        Generated tokens are those the output kept: a stop string inside a run of accepted
        drafts cuts the rest, which no step without drafts would have made."""
        totals, i = [], 0
        for outputs, engine in zip(steps, engines):
            counted = [c for c in seen[i:i + len(outputs)] if c is not None]
            i += len(outputs)
            if not counted:
                continue
            step = StepTokens(engine)
            for request_id, prompt, generated in counted:  # an n > 1 request's samples add up
                self.num_prompt_tokens += prompt
                self.num_generation_tokens += generated
                shown = step.by_request.get(request_id, 0)
                step.by_request[request_id] = shown + prompt + generated
            totals.append(step)
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
