"""The KV cache's element type (vLLM's --kv-cache-dtype): the model's ("auto") or fp8, and how a
K/V row is stored into an fp8 cache (divided by its scale, rounded to nearest even, saturated)
and read back (times the scale; the scales: kv_cache_scales.py)."""
import torch

from kiln.errors import ConfigError

# vLLM's names: "fp8" is e4m3 (OCP float8_e4m3fn), as on its CUDA platforms.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
CACHE_DTYPES = ("auto", *FP8_DTYPES)


def check_cache_dtype(name: str) -> None:
    if name not in CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype (--kv-cache-dtype) must be one of "
                          f"{', '.join(CACHE_DTYPES)}, got {name!r}")


def torch_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: the model's for "auto", else the fp8 format named."""
    check_cache_dtype(name)
    return FP8_DTYPES.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the cache's dtype. Into fp8, x / scale in float32 (one rounding, as vLLM's write and
    the C kernels' divide), saturated to its largest finite value first (448 for e4m3fn, 57344
    for e5m2), as vLLM's cache write does: torch's own conversion would make an e4m3fn NaN or
    an e5m2 infinity of an overflow. A scale of 1.0 (no checkpoint scales) divides by nothing."""
    if x.dtype == cache_dtype:
        return x
    if is_fp8(cache_dtype):
        if scale != 1.0:
            x = x.float() / scale
        top = torch.finfo(cache_dtype).max
        return x.clamp(-top, top).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """A cache's values in dtype: an fp8 cache's times its scale (in float32, one rounding)."""
    if scale != 1.0 and is_fp8(stored.dtype):
        return (stored.float() * scale).to(dtype)
    return stored.to(dtype)


def through_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as reading it back from a cache of cache_dtype gives it (x itself unless fp8)."""
    if not is_fp8(cache_dtype):
        return x
    return from_cache(to_cache(x, cache_dtype, scale), x.dtype, scale)
