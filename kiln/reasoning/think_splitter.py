"""`ThinkSplitter`: splits an answer, whole or delta by delta, into reasoning and content.

One state machine serves both, so a streamed answer's pieces join to the whole one's: inside
the thinking until </think>; a <think> at the very start (after whitespace) opens it; a tag
split across deltas is held back until it is whole.
"""
START, END = "<think>", "</think>"


def prompt_opens_thinking(prompt: str | None) -> bool | None:
    """Whether the rendered prompt leaves a <think> open (the answer starts inside it), closed
    (False), or says nothing (None)."""
    if not prompt:
        return None
    opened, closed = prompt.rfind(START), prompt.rfind(END)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


def _held(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    def __init__(self, start_in_reasoning: bool, keep_reasoning: bool = True):
        self.in_reasoning = start_in_reasoning
        # include_reasoning=false: the thinking is split off and dropped (never in content)
        self.keep_reasoning = keep_reasoning
        self._at_start = True  # nothing but whitespace seen: a <think> may still open
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of the answer."""
        text = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while text:
            if self._at_start:
                stripped = text.lstrip()
                if stripped.startswith(START):  # the model opens the thinking itself
                    text = stripped[len(START):]
                    self.in_reasoning, self._at_start = True, False
                    continue
                if not final and (not stripped or START.startswith(stripped)):
                    self._pending = text  # whitespace, or the start of <think>: undecided
                    break
                self._at_start = False
            if not self.in_reasoning:
                content.append(text)
                break
            at = text.find(END)
            if at >= 0:
                reasoning.append(text[:at])
                text = text[at + len(END):]
                self.in_reasoning = False
                continue
            keep = 0 if final else _held(text, END)
            reasoning.append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            break
        return "".join(reasoning) if self.keep_reasoning else "", "".join(content)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer: (reasoning or None, content or None)."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None
