"""Text to token ids for every caller (prompts, /tokenize, bad words, grammars): the Rust
backend's offset-free batch encode where the tokenizer has one, else the tokenizer's __call__.

Why: a fast tokenizer's __call__ computes character offsets nobody here reads, and building them
holds the GIL (about 110 ms on a 4 MB text, 2-core EPYC), so a front-end thread tokenizing a big
body froze the server's event loop; `encode_batch_fast` releases the GIL for all its work and
takes half the CPU. The ids are the same: both run the backend's one pipeline.
"""


def _plain_backend(tokenizer):
    """The `tokenizers.Tokenizer` that `tokenizer(text)` would run unchanged, or None when
    __call__ would do more than encode (truncation or padding set on the backend, special
    tokens split differently, an older tokenizers without `encode_batch_fast`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(tokenizer, "split_special_tokens", False)) != backend.encode_special_tokens:
        return None
    return backend


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer(text, add_special_tokens=...).input_ids` as a list, without offsets."""
    backend = _plain_backend(tokenizer)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
