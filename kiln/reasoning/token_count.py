"""`ReasoningTokenCounter`: how many of an answer's tokens are its thinking, for usage's
completion_tokens_details.reasoning_tokens (which vLLM reports with a reasoning parser).

It reads token ids as ThinkSplitter reads text: a <think> opens the thinking only as the
answer's first token but whitespace, a </think> closes it; the tags themselves are not counted
(as vLLM's count_reasoning_tokens), nor the whitespace the splitter drops before an opening tag.
"""
from kiln.engine.text_encoding import encode_text
from kiln.reasoning.think_splitter import END, START


def think_tag_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of <think> and </think>, where each is one token (else None: no count)."""
    if tokenizer is None:
        return None
    start, end = (encode_text(tokenizer, tag, add_special_tokens=False) for tag in (START, END))
    return (start[0], end[0]) if len(start) == 1 and len(end) == 1 else None


def is_blank(tokenizer, token: int) -> bool:
    """Whether a token's text is all whitespace (as the splitter reads an answer's start)."""
    return not tokenizer.decode([token]).strip()


class ReasoningTokenCounter:
    def __init__(self, tag_ids: tuple[int, int], start_in_reasoning: bool,
                 is_blank=lambda token: False):
        """`is_blank(token)`: whether the token's text is all whitespace (the splitter still
        takes a <think> after it as the opening tag: "\n<think>a" counted 0 for thinking "a")."""
        self.start_id, self.end_id = tag_ids
        self.in_reasoning = start_in_reasoning
        self._is_blank = is_blank
        self._at_start = True
        self._blanks = 0  # whitespace tokens at the start: the thinking's unless a <think> follows
        self._count = 0

    @property
    def count(self) -> int:
        return self._count + (self._blanks if self.in_reasoning else 0)

    def feed(self, token_ids) -> None:
        for token in token_ids:
            if self._at_start:
                if token == self.start_id:  # the whitespace before it is dropped, as the tag
                    self.in_reasoning, self._at_start, self._blanks = True, False, 0
                    continue
                if self._is_blank(token):
                    self._blanks += 1
                    continue
                self._at_start = False
                self._count, self._blanks = self.count, 0
            if self.in_reasoning:
                if token == self.end_id:
                    self.in_reasoning = False
                else:
                    self._count += 1


def total_reasoning_tokens(counters) -> int | None:
    """The answers' reasoning tokens together; None where none was counted (no details)."""
    counters = [c for c in counters if c is not None]
    return sum(c.count for c in counters) if counters else None
