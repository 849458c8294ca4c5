"""A token's own bytes for OpenAI's logprob `bytes` field, where its text cannot hold them: a
token carrying part of a multi-byte character decodes to U+FFFD on its own.

OpenAI's field is there so that clients join the bytes of consecutive tokens into the text;
the UTF-8 of "\ufffd" (what vLLM reports) joins into replacement characters instead.
"""
from kiln.engine.byte_runs import byte_token_values
from kiln.engine.tokenizer_cache import cached_on

_FFFD = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling, inverted: the printable character that stands for each
    byte in a byte-level vocabulary -> the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder and of the decoders a Sequence holds."""
    import json

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return set()
    return {state.get("type"), *(d.get("type") for d in state.get("decoders") or ())}


def _byte_level(tokenizer) -> dict[str, int] | None:
    """The byte-level alphabet where the tokenizer decodes its vocabulary through it, else
    None; kept on the tokenizer."""
    return cached_on(tokenizer, "_kiln_byte_level_alphabet",
                     lambda t: _byte_level_alphabet() if "ByteLevel" in _decoder_types(t)
                     else None)


def _literal_ids(tokenizer) -> frozenset[int]:
    """Special and added tokens: stored as their text, not spelled in the byte alphabet."""
    return cached_on(tokenizer, "_kiln_literal_token_ids",
                     lambda t: frozenset(t.all_special_ids) | frozenset(t.get_added_vocab().values()))


def raw_token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes `token_id` stands for in the output (a byte-fallback token's byte, a byte-level
    token's bytes), or None where the tokenizer does not spell its tokens in bytes."""
    value = byte_token_values(tokenizer).get(token_id)
    if value is not None:
        return bytes([value])
    alphabet = _byte_level(tokenizer)
    if alphabet is None or token_id in _literal_ids(tokenizer):
        return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    try:
        return bytes(alphabet[c] for c in piece)
    except KeyError:
        return None


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The logprob entry's `bytes` for a token shown as `text`: the UTF-8 of the text, except
    where the text holds a replacement character and the token's own bytes are known."""
    if tokenizer is not None and _FFFD in text:
        raw = raw_token_bytes(tokenizer, token_id)
        if raw is not None:
            return list(raw)
    return list(text.encode("utf-8"))
