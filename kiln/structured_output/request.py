"""`StructuredOutputRequest`: one request's grammar in the core: the compile in flight, then the
matcher that follows its tokens and fills its row of each step's token bitmask."""
from concurrent.futures import Future

from kiln.logger import init_logger
from kiln.structured_output.spec import GrammarSpec

logger = init_logger(__name__)


class StructuredOutputRequest:
    """`reasoning_end_ids`: a callable giving the token ids that end the reasoning (None: the
    grammar applies from the first token); until the output ends with them, nothing is
    constrained and the matcher sees no token."""

    def __init__(self, spec: GrammarSpec, compiled: Future, make_matcher,
                 reasoning_end_ids=None):
        self.spec = spec
        self._compiled = compiled
        self._make_matcher = make_matcher  # compiled grammar -> matcher
        self._reasoning_end_ids = reasoning_end_ids
        self._end_ids: list[int] = []
        self.in_reasoning = reasoning_end_ids is not None
        self._tail: list[int] = []  # the last output tokens, while in reasoning
        self.matcher = None
        self.error: str | None = None  # set when the grammar could not be compiled

    def is_ready(self) -> bool:
        """Compiled (the matcher exists) or failed; False while the compile is still running."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            if self.in_reasoning:
                self._end_ids = self._reasoning_end_ids()
                self.in_reasoning = bool(self._end_ids)
            self.matcher = self._make_matcher(self._compiled.result())
        except Exception as e:  # noqa: BLE001 - reported as the request's error
            self.error = f"{self.spec.field} could not be compiled: {e}"
        return True

    def wait(self, timeout: float) -> None:
        try:
            self._compiled.exception(timeout=timeout)
        except TimeoutError:
            pass

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not once the grammar has ended)."""
        return (self.matcher is not None and not self.in_reasoning
                and not self.matcher.is_terminated())

    @property
    def ended(self) -> bool:
        """Whether the grammar has taken its last token (a stop token): it allows nothing more."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar refuses it, which happens only
        where it allowed no token at all (a dead end such as the regex [^\\s\\S]): the
        sampler then had nothing to draw."""
        if self.in_reasoning:
            n = len(self._end_ids)
            self._tail = (self._tail + [token_id])[-n:]
            self.in_reasoning = self._tail != self._end_ids
            return True
        if not self.active:
            return True
        return self.matcher.accept_token(token_id)  # refused: the scheduler ends the request
