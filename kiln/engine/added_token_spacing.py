"""spaces_between_special_tokens=False (vLLM's): an added token right after another added token
is written as its own text, without the spaces the tokenizer's decoder puts before it."""
from kiln.engine.tokenizer_cache import cached_on


def added_token_texts(tokenizer) -> dict[int, str]:
    """Id -> text of every added token (special or not, as vLLM's detokenizer counts them),
    cached on the tokenizer."""
    def compute(tokenizer) -> dict[int, str]:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        return {i: getattr(tok, "content", str(tok)) for i, tok in added.items()}
    return cached_on(tokenizer, "_kiln_added_token_texts", compute)


class AddedTokenJoin:
    """Follows one sequence's output tokens and drops the spaces a decoder wrote between two
    added tokens in a row ("<s> </s>" -> "<s></s>", WordPiece's), as vLLM's detokenizer does
    for a request with skip_special_tokens=False and spaces_between_special_tokens=False. The
    first output token counts as following no added token (vLLM's too)."""

    def __init__(self, texts: dict[int, str]):
        self.texts = texts
        self.after_added = False

    def piece(self, token_id: int, piece: str) -> str:
        """The text of output token `token_id`, `piece` as the decode gave it."""
        text = self.texts.get(token_id)
        if text is not None and self.after_added and text and piece.endswith(text):
            # only spaces right before the token: the decoder's; text before them came from
            # earlier tokens (a held-back character)
            piece = piece[:len(piece) - len(text)].rstrip(" ") + text
        self.after_added = text is not None
        return piece


def added_token_join(tokenizer, skip_special_tokens: bool,
                     spaces_between_special_tokens: bool) -> AddedTokenJoin | None:
    """The join a request needs, None where it changes nothing: spaces between special tokens
    asked for, special tokens skipped (vLLM's rule), or a tokenizer without added tokens."""
    if spaces_between_special_tokens or skip_special_tokens:
        return None
    texts = added_token_texts(tokenizer)
    return AddedTokenJoin(texts) if texts else None
