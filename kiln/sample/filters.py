"""Sampling filters as pure functions: top-k, top-p (nucleus) and min-p masks over logits.

Each returns logits with excluded tokens set to -inf; rows whose setting is "off" are unchanged.
"""
import torch

_NEG_INF = float("-inf")


# A row's nucleus is looked for among its top 256 tokens (torch.topk), then its top 2048, and
# only then in the whole sorted row: sorting a whole vocabulary costs many times a top-k, and
# the top 256 usually holds the nucleus (figures: docs/measurements.md).
_CANDIDATES = (256, 2048)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k highest logits per row (ties with the k-th are kept). top_k [N], 0 = off."""
    vocab_size = logits.shape[1]
    on = (top_k > 0) & (top_k < vocab_size)  # [N]
    if not bool(on.any()):
        return logits
    k = torch.where(on, top_k, 1)
    top = logits.topk(int(k.max()), dim=1).values  # [N, max k], descending
    kth = torch.where(on.unsqueeze(1), top.gather(1, (k - 1).unsqueeze(1)), _NEG_INF)  # [N, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def _nucleus_floor(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per row of probs [N, V], the least probability among the tokens kept for top_p p [N, 1]:
    those whose more likely tokens hold less than p (at least one)."""
    vocab_size = probs.shape[1]
    floor = torch.empty_like(p)
    rows = torch.arange(probs.shape[0], device=probs.device)  # rows still looking
    for n in (*_CANDIDATES, vocab_size):
        first = rows.numel() == probs.shape[0]
        sub, want = (probs, p) if first else (probs[rows], p[rows])
        top = (sub.topk(n, dim=1) if n < vocab_size else sub.sort(dim=1, descending=True)).values
        held = top.cumsum(dim=1)  # [R, n]
        done = (held[:, -1:] >= want).squeeze(1) | (n >= vocab_size)  # the nucleus is in the top
        kept = ((held - top) < want).sum(dim=1, keepdim=True).clamp_min(1)
        floor[rows[done]] = top[done].gather(1, kept[done] - 1)
        rows = rows[~done]
        if rows.numel() == 0:
            return floor
    return floor


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p: a token
    stays when the tokens above it hold less than top_p (the most likely always stays; ties
    with the last kept are kept). top_p [N], 1.0 = off."""
    on = top_p < 1.0  # [N]
    if not bool(on.any()):
        return logits
    probs = logits.softmax(dim=1)  # [N, V]
    # Rows with top_p off look for a nucleus of 0 (found at once), then keep everything.
    floor = _nucleus_floor(probs, torch.where(on, top_p, 0.0).unsqueeze(1).to(probs.dtype))
    return logits.masked_fill(probs < torch.where(on.unsqueeze(1), floor, 0.0), _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's. min_p [N], 0 = off."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)
