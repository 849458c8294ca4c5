"""Per-request logit edits before penalties: allowed_token_ids, bad_words and logit_bias.

Pure functions over a batch; the (row, token) lists come from SamplingMetadata, built per step.
"""
import torch


class BadWordIndex:
    """A request's bad words (token ids) by the last token before their own last: a step looks
    only at the words the output's last token could complete (30,000 words checked one by one
    each step slowed every stream on the server)."""

    def __init__(self, bad_words_token_ids: list[list[int]]):
        self.always = [w[0] for w in bad_words_token_ids if len(w) == 1]
        self.by_end: dict[int, list[list[int]]] = {}
        for word in bad_words_token_ids:
            if len(word) > 1:
                self.by_end.setdefault(word[-2], []).append(list(word))

    def bans(self, output_token_ids) -> list[int]:
        """Tokens the row may not sample now: each bad word's last token, where the output ends
        in the word's other tokens (a one-token word: always)."""
        banned = list(self.always)
        if len(output_token_ids):
            for word in self.by_end.get(output_token_ids[-1], ()):
                n = len(word) - 1
                if len(output_token_ids) >= n and list(output_token_ids[-n:]) == word[:-1]:
                    banned.append(word[-1])
        return banned


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor,
                            allowed: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [R] keep only the tokens allowed [V] (bool, the same for every row) marks;
    in place."""
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """Add bias [C] to logits[r, cols] of every row r in rows [R]; in place. The [R, C] index
    is a broadcast view, never built (a whole-vocabulary bias at n=128 is 6M entries)."""
    return logits.index_put_((rows[:, None], cols), bias.to(logits.dtype).expand(len(rows), -1),
                             accumulate=True)
