"""`ReasoningTokenCounter`: how many of an answer's tokens are its thinking, for usage's
completion_tokens_details.reasoning_tokens (which vLLM reports with a reasoning parser).

It reads token ids as ThinkSplitter reads text: a <think> opens the thinking only as the
answer's first token, a </think> closes it; the tags themselves are not counted (as vLLM's
count_reasoning_tokens).
"""
from kiln.engine.text_encoding import encode_text
from kiln.reasoning.think_splitter import END, START


def think_tag_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of <think> and </think>, where each is one token (else None: no count)."""
    if tokenizer is None:
        return None
    start, end = (encode_text(tokenizer, tag, add_special_tokens=False) for tag in (START, END))
    return (start[0], end[0]) if len(start) == 1 and len(end) == 1 else None


class ReasoningTokenCounter:
    def __init__(self, tag_ids: tuple[int, int], start_in_reasoning: bool):
        self.start_id, self.end_id = tag_ids
        self.in_reasoning = start_in_reasoning
        self._at_start = True
        self.count = 0

    def feed(self, token_ids) -> None:
        for token in token_ids:
            at_start, self._at_start = self._at_start, False
            if at_start and token == self.start_id:
                self.in_reasoning = True
            elif self.in_reasoning:
                if token == self.end_id:
                    self.in_reasoning = False
                else:
                    self.count += 1


def total_reasoning_tokens(counters) -> int | None:
    """The answers' reasoning tokens together; None where none was counted (no details)."""
    counters = [c for c in counters if c is not None]
    return sum(c.count for c in counters) if counters else None
