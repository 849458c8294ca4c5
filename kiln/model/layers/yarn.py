"""YaRN rope scaling (Qwen3's and OLMo-3's long-context configs): HF's inverse frequencies, a
ramp from the original frequencies (fast dims) to ones slowed by `factor` (slow dims) between
the beta_fast / beta_slow rotation counts, and the attention factor cos and sin are scaled by."""
import math

import torch


def yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """[rotary_dim // 2] float32; rope.py has filled factor and original_max_position_embeddings."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in original
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    kept = 1 - ramp  # 1: the dim keeps its original frequency
    return extrapolated / factor * (1 - kept) + extrapolated * kept


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_mscale(scaling: dict) -> float:
    """HF's attention factor: the config's attention_factor, else from factor (and DeepSeek's
    mscale / mscale_all_dim where both are set)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(all_dim))
    return _mscale(factor)
