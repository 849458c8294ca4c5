"""Sampling filters as pure functions: top-k, top-p (nucleus) and min-p masks over logits.

Each returns logits with excluded tokens set to -inf; rows whose setting is "off" are unchanged.
"""
import torch

_NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k highest logits per row (ties with the k-th are kept). top_k [N], 0 = off."""
    vocab_size = logits.shape[1]
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # [N]
    sorted_desc = logits.sort(dim=1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (the most
    likely token always stays). top_p [N], 1.0 = off."""
    sorted_asc, idx = logits.sort(dim=1, descending=False)
    cum = sorted_asc.softmax(dim=1).cumsum(dim=1)  # [N, V], ascending probabilities
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    drop = drop & (top_p < 1.0).unsqueeze(1)
    mask = torch.zeros_like(drop).scatter_(1, idx, drop)
    return logits.masked_fill(mask, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's. min_p [N], 0 = off."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)
