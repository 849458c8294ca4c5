"""Per-request logit edits before penalties: allowed_token_ids, bad_words and logit_bias.

Pure functions over a batch; the (row, token) lists come from SamplingMetadata, built per step.
"""
import torch


def bad_word_bans(bad_words_token_ids: list[list[int]], output_token_ids) -> list[int]:
    """Tokens one row may not sample now: each bad word's last token, where the output ends in
    the word's other tokens (a one-token word: always)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix)
                          and list(output_token_ids[len(output_token_ids) - len(prefix):])
                          == prefix):
            banned.append(word[-1])
    return banned


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor,
                            allowed: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [R] keep only the tokens allowed [R, V] (bool) marks; in place."""
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """Add bias [M] to logits[rows[i], cols[i]]; in place."""
    return logits.index_put_((rows, cols), bias.to(logits.dtype), accumulate=True)
