"""Incremental detokenization and stop strings for one sequence.

Text is decoded over a small sliding window of token ids (prefix/read offsets) so each step costs
O(window), leading spaces and multi-byte characters split over several tokens come out right, and
the concatenated stream equals decoding all tokens at once.
"""
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.added_token_spacing import AddedTokenJoin, added_token_join
from kiln.engine.byte_runs import ByteRunRelease, byte_token_values, cached_anchor
from kiln.engine.text_encoding import keeps_stock
from kiln.engine.tokenizer_cache import cached_on

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
INITIAL_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to


def byte_fallback_token_ids(tokenizer) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens ("<0xE4>"), cached on the tokenizer.

    A run of them decodes as one unit (an invalid run turns every byte into U+FFFD): see
    byte_runs for how its characters are released before it ends.
    """
    return cached_on(tokenizer, "_kiln_byte_token_ids",
                     lambda t: frozenset(byte_token_values(t)))


def skipped_special_ids(tokenizer) -> frozenset[int]:
    """Ids a decode with skip_special_tokens drops, cached on the tokenizer: the named special
    tokens and every added token marked special (transformers lists only the named ones in
    all_special_ids; the tokenizers backend skips them all, e.g. SmolLM2's <repo_name>)."""
    def compute(tokenizer) -> frozenset[int]:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        return frozenset(getattr(tokenizer, "all_special_ids", ())).union(
            i for i, tok in added.items() if getattr(tok, "special", False))
    return cached_on(tokenizer, "_kiln_skipped_ids", compute)


# From this many ids fast_decode releases the GIL (the batch call costs 0.5 us more a call).
GIL_FREE_DECODE_IDS = 1024


def fast_decode(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or the `tokenizers` backend's own decode where transformers' adds
    nothing to it: a fast tokenizer whose class keeps the stock decode and that does not clean
    up tokenization spaces. transformers' wrapper took 3.3 us a call, the backend's 1.2; the
    detokenizer decodes twice per token of every request. Cached on the tokenizer."""
    return cached_on(tokenizer, "_kiln_fast_decode", _fastest_decode)


def _fastest_decode(tokenizer) -> Callable[..., str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    stock = keeps_stock(tokenizer, ("decode", "_decode"))
    if backend is not None and stock and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     True):
        def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
            if len(ids) < GIL_FREE_DECODE_IDS:
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)
            # The backend's decode holds the GIL throughout (a /detokenize of 600k ids froze
            # every stream for 240 ms); its batch decode lets it go.
            return backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return decode
    return tokenizer.decode


def decode_anchor(tokenizer) -> tuple[list[int], str] | None:
    """A plain token ("a") and its text, to decode in front of a lone token (see
    `lone_token_text`); None if the tokenizer has no such token."""
    try:
        ids = tokenizer.encode("a", add_special_tokens=False)[-1:]
        text = tokenizer.decode(ids) if ids else ""
    except (TypeError, ValueError, AttributeError):
        return None
    return (ids, text) if text else None


def lone_token_text(tokenizer, token_id: int, anchor: tuple[list[int], str] | None) -> str:
    """One token's text for a logprob entry: its own decode, with the leading spaces kept.

    SentencePiece decoders drop the first space of a text, so "▁the" alone decodes to "the"
    and the entries of a text no longer add up to it (nor do OpenAI's text offsets). Decoded
    after an anchor token the space stays; only spaces are ever taken from that decode.
    """
    alone = tokenizer.decode([token_id])
    if anchor is None:
        return alone
    anchor_ids, anchor_text = anchor
    joined = tokenizer.decode(anchor_ids + [token_id])
    if not joined.startswith(anchor_text):
        return alone
    text = joined[len(anchor_text):]
    return text if len(text) > len(alone) and text.lstrip(" ") == alone.lstrip(" ") else alone


def find_stop_string(text: str, num_new_chars: int, stop: list[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """(stop string, length to truncate text to) if a stop string ends in the new characters.

    Only matches overlapping the last `num_new_chars` are new, so earlier text is not re-scanned.
    The stop that completes first wins (then the longer one), as it would had the new
    characters come one token each: the cut must not depend on how the text was tokenized.
    """
    best: tuple[int, int, str] | None = None  # (end, -length, stop)
    for s in stop:
        idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if idx != -1 and (best is None or (idx + len(s), -len(s)) < best[:2]):
            best = (idx + len(s), -len(s), s)
    if best is None:
        return None
    end, neg_len, s = best
    return s, end if include_stop_str_in_output else end + neg_len


@dataclass
class IncrementalDetokenizer(ByteRunRelease):
    tokenizer: object
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    # False: no spaces between two added tokens in a row (vLLM's; added_token_spacing.py)
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # All ids decoded so far: the prompt's last few tokens (context) then the output tokens.
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    output_text: str = ""
    # Characters held back from DELTA streams because they may start a stop string.
    stop_buffer_length: int = 0
    # Stop strings count only once this many output tokens are out (as min_tokens holds back
    # eos and stop_token_ids in the sampler): they must end in text of later tokens.
    min_tokens: int = 0
    # Prompt tokens at the front of token_ids (read_offset starts there).
    num_context_tokens: int = 0
    _num_output_tokens: int = 0
    _num_streamed_chars: int = 0
    _byte_token_ids: frozenset = frozenset()
    _byte_values: dict = field(default_factory=dict)
    _anchor: tuple | None = None
    # The current byte run, split where its released characters end (see byte_runs).
    _split: int | None = None
    _split_text: str = ""
    _split_behind_text: bool = False
    _split_invalid: bool = False
    _run_start: int = 0
    _skipped_ids: frozenset = frozenset()
    _decode_ids: Callable[..., str] | None = None
    _join: AddedTokenJoin | None = None

    def __post_init__(self):
        self._byte_token_ids = byte_fallback_token_ids(self.tokenizer)
        self._byte_values = byte_token_values(self.tokenizer)
        if self._byte_values:
            self._anchor = cached_anchor(self.tokenizer)
        self._decode_ids = fast_decode(self.tokenizer)
        if self.skip_special_tokens:
            self._skipped_ids = skipped_special_ids(self.tokenizer)
        self._join = added_token_join(self.tokenizer, self.skip_special_tokens,
                                      self.spaces_between_special_tokens)

    @classmethod
    def for_request(cls, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                    stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                    min_tokens: int = 0, spaces_between_special_tokens: bool = True
                    ) -> "IncrementalDetokenizer":
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        stop = list(stop or [])
        buffer = 0 if include_stop_str_in_output or not stop else max(map(len, stop)) - 1
        return cls(tokenizer=tokenizer, skip_special_tokens=skip_special_tokens, stop=stop,
                   include_stop_str_in_output=include_stop_str_in_output, token_ids=context,
                   prefix_offset=0, read_offset=len(context), stop_buffer_length=buffer,
                   min_tokens=min_tokens, num_context_tokens=len(context),
                   spaces_between_special_tokens=spaces_between_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _ends_in_byte_run(self) -> bool:
        for tid in reversed(self.token_ids):
            if tid in self._skipped_ids:
                continue  # skipped specials vanish before decoding, joining the runs around them
            return tid in self._byte_token_ids
        return False

    def _byte_run_text(self, final: bool) -> str | None:
        """This step's text where a byte run decides it (None: a plain decode does): the run's
        whole characters as each completes; a split run ends at its final token or past it."""
        if self._ends_in_byte_run():
            released = self._release_in_run()
            if not final:
                return released
            if self._split is not None:  # (a run's last token: split as any other would be)
                return released + self._end_split()
        if self._split is not None:
            return self._end_split()
        return None

    def _decode_next(self, final: bool) -> str:
        """Text the window gained since read_offset; '' while it ends in a partial character."""
        if (text := self._byte_run_text(final)) is not None:
            return text
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        start = len(prefix_text)
        if self.read_offset == self.num_context_tokens and not full_text.startswith(prefix_text):
            # The prompt ends inside a character the output completes ("<0xE6>" + "<0x97><0xA5>"
            # is "日", not "�" + ...): the text from where they differ is the output's. Only
            # here, where none of the window's text was emitted yet, can that be taken back.
            start = len(os.path.commonprefix([prefix_text, full_text]))
        if len(full_text) <= start:
            return ""
        if full_text.endswith(_INCOMPLETE) and not final:
            return ""  # wait for the rest of the multi-byte character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[start:]

    def update(self, new_token_ids: list[int], final: bool = False,
               stop_terminated: bool = False) -> str | None:
        """Append tokens; returns the stop string if one appeared (text is then truncated).

        `final` flushes a trailing partial character (the request ends after these tokens).
        `stop_terminated`: the last of these tokens is the stop token (eos, stop_token_ids)
        that ended the request, kept for include_stop_str_in_output. Its text is searched for
        stop strings as all new text is (vLLM since PR #23938: a stop string found there wins,
        cut and reported); the text before it is settled first: a byte run the token ends.
        """
        stop_token = new_token_ids[-1:] if stop_terminated else []
        searched = new_token_ids[:len(new_token_ids) - len(stop_token)]
        new_chars = 0
        for i, tid in enumerate(searched):
            self.token_ids.append(tid)
            self._num_output_tokens += 1
            piece = self._decode_next(final and not stop_token and i == len(searched) - 1)
            if self._join is not None:
                piece = self._join.piece(tid, piece)
            self.output_text += piece
            # text up to the min_tokens-th token cannot end a stop string
            new_chars = 0 if self._num_output_tokens <= self.min_tokens else new_chars + len(piece)
        if not new_token_ids and final:
            piece = self._flush()
            self.output_text += piece
            if self._num_output_tokens > self.min_tokens:  # else it is too early, as above
                new_chars += len(piece)
        if stop_token:
            # The request ends here: the rest of the text by full decodes. What the tokens
            # before the stop token still held back (a byte run it ends) is theirs to search,
            # unless the stop token changes it (completes its character).
            held = self._held_text(self.token_ids)
            self.token_ids.append(stop_token[0])
            self._num_output_tokens += 1
            stop_text = self._held_text(self.token_ids)
            if held and stop_text.startswith(held):
                self.output_text += held
                stop_text = stop_text[len(held):]
                if self._num_output_tokens - 1 > self.min_tokens:
                    new_chars += len(held)
            if self._join is not None:
                stop_text = self._join.piece(stop_token[0], stop_text)
            self.output_text += stop_text
            if self._num_output_tokens > self.min_tokens:
                new_chars += len(stop_text)
        if self.stop and new_chars:
            hit = find_stop_string(self.output_text, new_chars, self.stop,
                                   self.include_stop_str_in_output)
            if hit is not None:
                self.output_text = self.output_text[:hit[1]]
                return hit[0]
        return None

    def _num_settled_tokens(self) -> int:
        """token_ids[:this] have given all their text."""
        return self.read_offset

    def _resume_at(self, split: int) -> None:
        """Decode on from token_ids[split:], all of whose text was given."""
        self.prefix_offset, self.read_offset = split, len(self.token_ids)

    def _text_after(self, start: int, ids: list[int]) -> str:
        """The text `ids` add to ids[:start], by full decodes (from where they differ: the
        prompt may end inside a character)."""
        full, before = self._decode(ids), self._decode(ids[:start])
        return full[len(os.path.commonprefix([full, before])):]

    def _flush(self) -> str:
        if self._split is not None:  # (no new token: the run's last byte was counted)
            return self._end_split()
        if self.read_offset >= len(self.token_ids):
            return ""
        return self._decode_next(final=True)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far, or (delta) only text not yet streamed; both hold back, until the
        request ends, the last characters that may start a stop string, so no output shows
        text a later stop string cuts (each CUMULATIVE output extends the one before)."""
        end = len(self.output_text) if finished else max(
            self._num_streamed_chars, len(self.output_text) - self.stop_buffer_length)
        if not delta:
            self._num_streamed_chars = end
            return self.output_text[:end]
        text = self.output_text[self._num_streamed_chars:end]
        self._num_streamed_chars = end
        return text
