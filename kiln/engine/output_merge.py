"""Folds the engine's DELTA outputs into CUMULATIVE / FINAL_ONLY ones: text, tokens and logprobs.

`AsyncLLM` always asks the engine for deltas (its metrics need each step's new tokens, whatever
the caller wants) and rebuilds the caller's kind here. The accumulator grows in place, so a
FINAL_ONLY request costs time linear in its length; a CUMULATIVE one copies its lists once per
output, as the engine's own CUMULATIVE outputs do.
"""
from dataclasses import dataclass, field

from kiln.outputs import CompletionOutput, RequestOutput


@dataclass
class _Sample:
    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def add(self, d: CompletionOutput) -> None:
        self.text_parts.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.logprobs)
        if d.cumulative_logprob is not None:
            self.cumulative_logprob = d.cumulative_logprob
        self.finish_reason = d.finish_reason or self.finish_reason
        if d.stop_reason is not None:
            self.stop_reason = d.stop_reason
        self.error = d.error or self.error

    def snapshot(self) -> CompletionOutput:
        text = "".join(self.text_parts)
        self.text_parts = [text]  # joined once, not again at every snapshot
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, error=self.error)


class DeltaAccumulator:
    """One request's deltas so far; `snapshot()` is the cumulative RequestOutput (fresh lists,
    so a caller holding an earlier snapshot never sees it change)."""

    def __init__(self):
        self._samples: dict[int, _Sample] = {}
        self._last: RequestOutput | None = None
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] = []
        self._num_cached_tokens = 0
        self._prompt_logprobs = None
        self._metrics = None

    def add(self, delta: RequestOutput) -> None:
        for d in delta.outputs:
            self._samples.setdefault(d.index, _Sample(d.index)).add(d)
        if delta.prompt is not None:
            self._prompt = delta.prompt
        self._prompt_token_ids = delta.prompt_token_ids or self._prompt_token_ids
        self._num_cached_tokens = max(self._num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:  # a DELTA stream carries them once
            self._prompt_logprobs = delta.prompt_logprobs
        self._metrics = delta.metrics or self._metrics
        self._last = delta

    def snapshot(self) -> RequestOutput:
        if self._last is None:
            raise ValueError("no delta has been added yet")
        return RequestOutput(
            request_id=self._last.request_id, prompt=self._prompt,
            prompt_token_ids=self._prompt_token_ids,
            outputs=[self._samples[i].snapshot() for i in sorted(self._samples)],
            finished=self._last.finished, num_cached_tokens=self._num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs, metrics=self._metrics)
