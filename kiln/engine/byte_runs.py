"""Early release of the characters of a byte-fallback run ("<0xF0><0x9F><0x98><0x80>" for 😀).

The `tokenizers` ByteFallback decoder decodes a run of byte tokens as one unit: a valid run is
its UTF-8 text, an invalid one (a bad byte anywhere, or a character cut off at the end) is one
U+FFFD per byte, the valid characters before the bad byte included. So no character of a run
is final until the run ends; holding the whole run streamed nothing for an all-emoji or
all-CJK-by-bytes reply until a non-byte token came. vLLM's DecodeStream releases each character
when its last byte arrives, and drops bytes it cannot place (😀 <0xFF> "▁a" gives "😀a").

Kiln releases each character when its last byte arrives too, and never takes text back: the
released characters split the run there, and what follows the split decodes as a run of its
own (so a bad byte after a released 😀 is "😀�", not the full decode's "�����", nor vLLM's
"😀"). The text is the full decode's except where a run has complete characters before a bad
byte (or an unfinished last character); without released characters the run is the decoder's.
A run that began in the prompt is split where the prompt's final bytes end (all but a
partial character the output may complete): they are the prompt's text, not the output's.
Once the part after the split cannot become valid, each of its bytes is a final U+FFFD and is
released as it arrives. Text after a split is decoded behind an anchor token (see
`decode_anchor`), so a leading space survives SentencePiece's strip.
"""
import os
import re

from kiln.engine.tokenizer_cache import cached_on

_FFFD = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_token_values(tokenizer) -> dict[int, int]:
    """id -> byte of the SentencePiece byte-fallback tokens ("<0xE4>"), cached on the
    tokenizer. Only tokens the decoder turns into their byte: a byte-level BPE (or any decoder
    without ByteFallback) may have a token spelled "<0xE4>" that is that text, and splitting
    "runs" of those repeated text in the stream."""
    def compute(tokenizer) -> dict[int, int]:
        values = {}
        for tok, i in tokenizer.get_vocab().items():
            m = _BYTE_TOKEN.fullmatch(tok)
            if m and tok not in tokenizer.decode([i]):
                values[i] = int(m.group(1), 16)
        return values
    return cached_on(tokenizer, "_kiln_byte_token_values", compute)


def valid_prefix(data: bytes) -> tuple[int, bool]:
    """(length of the longest prefix of whole valid characters, whether the rest can no
    longer become valid UTF-8 whatever bytes follow)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start, e.reason != "unexpected end of data"
    return len(data), False


def final_prefix(data: bytes) -> int:
    """Bytes of `data` (a prompt's part of a byte run) no later byte can change: all but a
    trailing partial character, which the output may complete."""
    for tail in range(min(3, len(data)), 0, -1):
        if valid_prefix(data[-tail:]) == (0, False):  # the start of a character, cut off
            return len(data) - tail
    return len(data)


def cached_anchor(tokenizer):
    from kiln.engine.detokenizer import decode_anchor  # it imports this module

    return cached_on(tokenizer, "_kiln_decode_anchor", decode_anchor)


class ByteRunRelease:
    """Mixin of the incremental detokenizers. Needs token_ids, _decode, _skipped_ids,
    _byte_values, _anchor, _split (token index where the unreleased part of the current run
    begins, None outside a split run), _split_text (the text after the split already given),
    _split_behind_text (text precedes the split: decode behind the anchor), _split_invalid
    (the decoder gave the part after the split one U+FFFD a byte: it can only grow so), _run_start,
    _num_settled_tokens() and _resume_at(index)."""

    def _anchored(self, ids: list[int], behind_text: bool) -> str | None:
        """The text of `ids` after some text (None: no anchor token to decode behind). At the
        very start of the text (not `behind_text`) the decoder's own strip applies, as in a
        full decode."""
        if self._anchor is None:
            return None
        if not behind_text:
            return self._decode(ids)
        anchor_ids, anchor_text = self._anchor
        text = self._decode(anchor_ids + ids)
        # (a decoder that changes the anchor's text: the plain decode, at worst a space short)
        return text[len(anchor_text):] if text.startswith(anchor_text) else self._decode(ids)

    def _gain_after_split(self, end: int) -> tuple[str, str]:
        """(new text, all text) of token_ids[_split:end] beyond what was given of it."""
        text = self._anchored(self.token_ids[self._split:end], self._split_behind_text) or ""
        return text[len(os.path.commonprefix([text, self._split_text])):], text

    def _release_in_run(self) -> str:
        """Inside a byte run: the characters it completed and the final U+FFFDs."""
        ids, values = self.token_ids, self._byte_values
        if self._split is None:
            start = i = len(ids)
            while i > 0 and (ids[i - 1] in values or ids[i - 1] in self._skipped_ids):
                i -= 1
                if ids[i] in values:
                    start = i
            if self._anchor is None:
                return ""  # no anchor token: the run is held to its end, whole
            settled = self._num_settled_tokens()
            base = min(start, settled)
            if base < settled:
                # The run began in the prompt: its final bytes ("\n" as <0x0A>, a chat
                # template's last token) are the prompt's text. Decoded with the output's they
                # took part in its validity: an output byte that cannot be valid turned them
                # into U+FFFD, and the output's text began with a character of the prompt.
                prompt_bytes = [j for j in range(base, settled) if ids[j] in values]
                kept = final_prefix(bytes(values[ids[j]] for j in prompt_bytes))
                if kept:
                    base = prompt_bytes[kept - 1] + 1
            behind = bool(self.output_text) or bool(self._decode(ids[:base]))
            before = self._anchored(ids[base:settled], behind) if base < settled else ""
            self._split, self._split_text, self._run_start = base, before or "", start
            self._split_behind_text, self._split_invalid = behind, False
        if self._split_invalid:
            # One U+FFFD a byte from here on, without a decode: a long bad run decoded whole
            # at each byte took quadratic time (3000 bytes: 4 s).
            if ids[-1] not in values:
                return ""
            self._split_text += _FFFD
            return _FFFD
        settled = self._num_settled_tokens()
        positions = [j for j in range(max(self._split, self._run_start), len(ids))
                     if ids[j] in values]
        p, invalid = valid_prefix(bytes(values[ids[j]] for j in positions))
        out = ""
        if p and positions[p - 1] + 1 > settled:  # whole characters (not all the prompt's)
            out, _ = self._gain_after_split(positions[p - 1] + 1)
            self._split, self._split_text = positions[p - 1] + 1, ""
            self._split_behind_text = self._split_behind_text or bool(out)
        if invalid:  # the rest is one U+FFFD a byte, now and whatever follows in the run
            piece, self._split_text = self._gain_after_split(len(ids))
            out += piece
            num_bytes = sum(1 for j in range(self._split, len(ids)) if ids[j] in values)
            self._split_invalid = self._split_text.endswith(_FFFD * num_bytes)
        return out

    def _held_text(self, ids: list[int]) -> str:
        """The text `ids` add beyond what was given (the unsettled tokens, by full decodes)."""
        if self._split is not None:
            text = self._anchored(ids[self._split:], self._split_behind_text) or ""
            return text[len(os.path.commonprefix([text, self._split_text])):]
        return self._text_after(self._num_settled_tokens(), ids)

    def _end_split(self) -> str:
        """The run split by released characters ended: the rest of its text and the next
        token's; decoding resumes from the split."""
        piece, _ = self._gain_after_split(len(self.token_ids))
        split, self._split, self._split_text = self._split, None, ""
        self._resume_at(split)
        return piece
