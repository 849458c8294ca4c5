"""Text to token ids for every caller (prompts, /tokenize, bad words, grammars): the Rust
backend's offset-free batch encode where the tokenizer's own call would run just that, else
the tokenizer's __call__.

Why: a fast tokenizer's __call__ computes character offsets nobody here reads, and building them
holds the GIL, so a front-end thread tokenizing a big body froze the server's event loop
(docs/architecture.md has the figures); `encode_batch_fast` releases the GIL for all its work.
The ids are the same: both run the backend's one pipeline.
"""
import functools

# What a fast tokenizer's __call__ goes through (transformers 5; 4.x's names too): a class that
# overrides one of them (CodeLlama's fill-in-the-middle _encode_plus) adds to the backend's work.
_ENCODE_METHODS = ("__call__", "_call_one", "encode_plus", "_encode_plus", "_batch_encode_plus")


@functools.cache
def _class_keeps_stock(cls: type, names: tuple[str, ...]) -> bool:
    from transformers import PreTrainedTokenizerFast

    return issubclass(cls, PreTrainedTokenizerFast) and all(
        getattr(cls, name) is getattr(PreTrainedTokenizerFast, name)
        for name in names if hasattr(PreTrainedTokenizerFast, name))


def keeps_stock(tokenizer, names: tuple[str, ...]) -> bool:
    """Whether `tokenizer` is a transformers fast tokenizer whose class overrides none of the
    methods `names`: what they do is then the `tokenizers` backend's work alone."""
    return _class_keeps_stock(type(tokenizer), names)


def plain_backend(tokenizer):
    """The `tokenizers.Tokenizer` that `tokenizer(text)` would run unchanged, or None when
    __call__ would do more than encode (a class that overrides it, truncation or padding set on
    the backend, special tokens split differently, an older tokenizers without
    `encode_batch_fast`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if not keeps_stock(tokenizer, _ENCODE_METHODS):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(tokenizer, "split_special_tokens", False)) != backend.encode_special_tokens:
        return None
    return backend


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer(text, add_special_tokens=...).input_ids` as a list, without offsets."""
    backend = plain_backend(tokenizer)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def encoding_problem(text: str) -> str | None:
    """Why a tokenizer cannot take `text` (a lone UTF-16 surrogate, JSON's "\\ud800"), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"contains a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}); "
                "send valid Unicode text")
    return None


def not_utf8(text: str) -> str | None:
    """Why text read from a command line, a file or stdin is not UTF-8 ("is not UTF-8 text
    (byte 0xff at character 2)"), or None: bytes that are not UTF-8 reach Python as lone
    surrogates (U+DC80-U+DCFF stand for bytes 0x80-0xFF), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.start
    else:
        return None
    ch = text[bad]
    what = (f"byte 0x{ord(ch) - 0xDC00:02x}" if "\udc80" <= ch <= "\udcff"
            else f"a lone surrogate {ch!r}")
    return f"is not UTF-8 text ({what} at character {bad})"


def check_encodable(text: str, field: str) -> None:
    """Refuse text the tokenizer would fail on deep inside, naming the field."""
    problem = encoding_problem(text)
    if problem is not None:
        raise ValueError(f"{field} {problem}")


def check_request_id(request_id) -> None:
    """A request id crosses to the engine core as UTF-8 text: a lone surrogate (JSON's
    "\\ud800") or a non-str failed there, with an error that named no field."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
    check_encodable(request_id, "request_id")


def check_texts(name: str, texts) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's "\\ud800") in strings the engine encodes: a stop
    string failed on its way to the engine core (a bare UnicodeEncodeError), a bad word inside
    the tokenizer (a TypeError)."""
    for text in texts:
        if (problem := encoding_problem(text)) is not None:
            raise ValueError(f"{name} {problem}")
