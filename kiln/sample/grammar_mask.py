"""Structured outputs in the sampler: the scheduler's token bitmask (one int32 word per 32 token
ids, bit set = allowed) masks each constrained row's disallowed logits to -inf.

Pure tensor code that runs on any device; the runner picks the rows, the sampler applies them.
"""
import numpy as np
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [M, W] -> bool [M, vocab_size] of allowed tokens (ids past W * 32: not allowed)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32,
                                                        device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [M, W * 32]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
    """A copy of logits [N, V] whose rows `rows` [M] keep only the tokens bitmask [M, W] allows."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [M, V]
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def bitmask_rows(sample_req_ids: list[str], structured_req_ids: list[str],
                 bitmask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Match the scheduler's bitmask rows (structured_req_ids order) to the sampler's rows
    (sample_req_ids order): (sampler row per mask row [M] int64, the masks [M, W]), or None."""
    if bitmask is None or not structured_req_ids:
        return None
    where = {r: i for i, r in enumerate(sample_req_ids)}
    pairs = [(where[r], i) for i, r in enumerate(structured_req_ids) if r in where]
    if not pairs:
        return None
    rows, mask_rows = (np.asarray(x, dtype=np.int64) for x in zip(*pairs))
    return rows, bitmask[mask_rows]
