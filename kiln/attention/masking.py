"""Which keys a query attends (causal, within a layer's sliding window) and the soft cap of its
scores: pure functions the torch backend, the CPU backend's planning and the tests share."""
import torch


def first_key(query_pos: int, window: int | None) -> int:
    """The first key position a query at `query_pos` sees: 0, or the start of its window (it sees
    the last `window` keys, its own included, as HF's and vLLM's sliding windows)."""
    return 0 if window is None else max(0, query_pos + 1 - window)


def key_mask(query_pos: torch.Tensor, key_pos: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """[Q, S] bool, True where the query at query_pos [Q] sees the key at key_pos [S]."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-2's attention logit soft-capping of scaled scores: cap * tanh(scores / cap)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap
