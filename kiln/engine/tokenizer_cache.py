"""Values derived from a tokenizer once and kept on it (its byte tokens, special ids, fastest
decode): every request's detokenizer asks for them, and the first to ask computes them."""
from collections.abc import Callable

_MISSING = object()


def cached_on(tokenizer, name: str, compute: Callable):
    """`compute(tokenizer)`, kept on the tokenizer as attribute `name`; a tokenizer that takes
    no attributes computes it at each call."""
    value = getattr(tokenizer, name, _MISSING)
    if value is _MISSING:
        value = compute(tokenizer)
        try:
            setattr(tokenizer, name, value)
        except AttributeError:
            pass
    return value
