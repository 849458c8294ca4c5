"""Detokenization through `tokenizers`' own DecodeStream for fast tokenizers, and the choice of
detokenizer a request gets (DecodeStream, the Python incremental one, or none: no text).
"""
import os
from dataclasses import dataclass
from typing import Any

from kiln.engine.detokenizer import _INCOMPLETE, INITIAL_CONTEXT_TOKENS, IncrementalDetokenizer, fast_decode

# False: every tokenizer uses the Python incremental detokenizer (tests run both).
USE_DECODE_STREAM = True
_MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 byte tokens


def decode_stream_backend(tokenizer):
    """The `tokenizers` backend DecodeStream can step, or None where the tokenizer's decode is
    more than the backend's (a slow tokenizer, a custom decode, tokenization-space cleanup):
    there the stream's text would not equal tokenizer.decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or fast_decode(tokenizer) == tokenizer.decode:
        return None
    return backend


@dataclass
class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """IncrementalDetokenizer's stop strings and hold-back over a DecodeStream (Rust): one step
    a token instead of two Python-side decodes of the window."""
    _stream: Any = None
    _backend: Any = None
    _emitted: int = 0  # token_ids[:_emitted] have given all their text
    # Ids not yet stepped: a byte-fallback run goes into the stream whole, as a full decode
    # reads it (an invalid run turns all its bytes into U+FFFD, retroactively); a run split by
    # released characters (byte_runs) restarts the stream at the split instead.
    _pending: list = None
    # The prompt ends inside a character: its first text is found by decoding (see below).
    _partial_prompt_end: bool = False

    def __post_init__(self):
        from tokenizers.decoders import DecodeStream

        super().__post_init__()
        self._backend = decode_stream_backend(self.tokenizer)
        context = self.token_ids[:self.num_context_tokens]
        # A prompt ending in part of a character: the stream would restart its text there
        # ("Once upon日"); the context stops before that part, stepped in (silent) below.
        carry = 0
        while (carry < min(len(context), _MAX_CHAR_TOKENS)
               and self._decode(context[:len(context) - carry]).endswith(_INCOMPLETE)):
            carry += 1
        self._partial_prompt_end = carry > 0
        self._stream = DecodeStream(ids=context[:len(context) - carry],
                                    skip_special_tokens=self.skip_special_tokens)
        if carry:
            self._step(context[len(context) - carry:])
        self._emitted = len(context)
        self._pending = []

    def _step(self, token_ids: list[int]) -> str | None:
        try:
            return self._stream.step(self._backend, token_ids)
        except Exception:  # noqa: BLE001 - an id the backend cannot extend its prefix with
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=self.token_ids[-INITIAL_CONTEXT_TOKENS:],
                                        skip_special_tokens=self.skip_special_tokens)
            return self._decoded_since_emitted(first=False) or None

    def _decoded_since_emitted(self, first: bool) -> str:
        """The text token_ids gained after token_ids[:_emitted], by decoding both."""
        full = self._decode(self.token_ids)
        before = self._decode(self.token_ids[:self._emitted])
        if first or not full.startswith(before):
            # As the Python detokenizer: text from where they differ belongs to the output.
            return full[len(os.path.commonprefix([full, before])):]
        return full[len(before):]

    def _decode_next(self, final: bool) -> str:
        self._pending.append(self.token_ids[-1])
        if (text := self._byte_run_text(final)) is not None:
            return text
        chunk = self._step(self._pending)
        self._pending = []
        if chunk is None and not final:
            return ""  # inside a multi-byte character: the stream holds it back
        if self._partial_prompt_end or chunk is None:
            # The first text after a prompt's partial character, or a final flush of bytes the
            # stream still holds (a character never completed): what a full decode adds.
            chunk = self._decoded_since_emitted(first=self._partial_prompt_end)
            self._partial_prompt_end = False
        self._emitted = len(self.token_ids)
        return chunk

    def _num_settled_tokens(self) -> int:
        return self._emitted

    def _resume_at(self, split: int) -> None:
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(ids=self.token_ids[split:],
                                    skip_special_tokens=self.skip_special_tokens)
        self._emitted, self._pending, self._partial_prompt_end = len(self.token_ids), [], False

    def _flush(self) -> str:
        if self._split is not None:
            return self._end_split()
        if self._emitted >= len(self.token_ids):
            return ""
        piece = self._decoded_since_emitted(first=self._partial_prompt_end)
        self._emitted = len(self.token_ids)
        return piece


class NoTextDetokenizer:
    """For requests with detokenize=False or an engine without a tokenizer: no text, ever."""
    output_text = ""

    def update(self, new_token_ids: list[int], final: bool = False,
               stop_terminated: bool = False) -> None:
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""


def detokenizer_for_request(tokenizer, prompt_token_ids: list[int], *, detokenize: bool = True,
                            **kwargs):
    """The detokenizer of one sequence: DecodeStream where the tokenizer allows it, else the
    Python incremental one; none without a tokenizer or with detokenize=False."""
    if tokenizer is None or not detokenize:
        return NoTextDetokenizer()
    cls = IncrementalDetokenizer
    if USE_DECODE_STREAM and decode_stream_backend(tokenizer) is not None:
        cls = FastIncrementalDetokenizer
    return cls.for_request(tokenizer, prompt_token_ids, **kwargs)
