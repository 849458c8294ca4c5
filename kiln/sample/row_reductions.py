"""Reductions over vocabulary-sized rows that torch's CPU kernels do slowly: on CPU in float32
they go through numpy (same results), elsewhere through torch.
"""
import numpy as np
import torch


def _as_numpy(x: torch.Tensor) -> np.ndarray | None:
    """x as a numpy array sharing its memory when numpy can take it (CPU float32, no autograd,
    no lazy negation), else None."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not (x.requires_grad or x.is_neg()):
        return x.numpy()
    return None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V].argmax(dim=1) (int64; the first maximum, NaN counting as the largest), in numpy
    where it can: an order of magnitude faster than torch's CPU reduction on a few rows
    (docs/measurements.md)."""
    a = _as_numpy(x)
    return x.argmax(dim=1) if a is None else torch.from_numpy(a.argmax(axis=1))


def count_at_least(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Per row of x [N, V], how many entries are >= value [N, 1] (int64 [N]), in numpy where
    it can: several times faster than torch's comparison and bool sum (docs/measurements.md).
    vLLM's batched_count_greater_than (its logprob rank: ties count against the token)."""
    a, v = _as_numpy(x), _as_numpy(value)
    if a is None or v is None:
        return (x >= value).sum(dim=1)
    return torch.from_numpy((a >= v).sum(axis=1))


def has_nan_or_posinf(x: torch.Tensor) -> bool:
    """Whether x holds a NaN or +inf anywhere (-inf is fine): its max is then NaN or +inf
    (numpy's max where it can: far cheaper than torch's CPU amax, docs/measurements.md)."""
    if x.numel() == 0:
        return False
    a = _as_numpy(x)
    top = float(x.amax()) if a is None else float(a.max())
    return not top < float("inf")
