"""YaRN rope scaling (Qwen3's, OLMo-3's and DeepSeek-V2/V3's long-context configs): frequencies
blended between interpolated and original by a linear ramp over the rotary dims, and its two
magnitude factors.

HF's formulas (modeling_rope_utils' yarn): cos / sin scaled by the attention factor
(mscale / mscale_all_dim), and the MLA models' softmax scale by mscale_all_dim's factor squared.
"""
import math

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(scale) + 1, 1 for no extension."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """What cos and sin are multiplied by: attention_factor where given, else the ratio of
    mscale's and mscale_all_dim's factors where both are set, else mscale of the factor alone."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def yarn_softmax_mscale(scaling: dict | None) -> float:
    """The factor an MLA model's softmax scale takes (mscale_all_dim's, squared; 1 without).
    Any rope scaling that sets mscale_all_dim, not only yarn (HF's yarn_apply_mscale, vLLM)."""
    if scaling is None or scaling["rope_type"] == "default" or not scaling.get("mscale_all_dim") \
            or not scaling.get("factor"):
        return 1.0
    m = yarn_get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
    return m * m


def _correction_dim(rotations: float, dim: int, base: float, length: int) -> float:
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32: original ones where a dim turns fast
    enough (beta_fast), divided by `factor` where slow (beta_slow), a linear ramp between."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low = _correction_dim(beta_fast, rotary_dim, base, original)
    high = _correction_dim(beta_slow, rotary_dim, base, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep
