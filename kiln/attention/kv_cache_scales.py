"""An fp8 KV cache's per-layer scales from a checkpoint (vLLM's k_scale / v_scale): the checkpoint
tensor names that carry them, which quantization methods read them, their checks, the scales a
layer runs with, the warning for a cache left at 1.0, and the cache dtype a compressed-tensors
kv_cache_scheme implies.

A cache stores x / scale (rounded to fp8) and reads back stored * scale; a scale of 1.0 is the
plain cast. They are scalars per layer (vLLM's per-tensor case); anything else is refused.
"""
import math
import re

import torch

from kiln.errors import ConfigError

# Checkpoint names of a KV scale -> the scale it holds, as vLLM reads them (its compressed-tensors
# get_cache_scale and maybe_remap_kv_scale_name), in order of precedence: `X.attn.k_scale`
# (vLLM's own), `X.k_proj.k_scale` (ModelOpt), `X.qkv_proj.k_scale` (a fused projection's),
# `X.k_cache.scale` / `X.q.scale` (Hunyuan), `X.k_proj.output_scale` (llm-compressor's older
# names), `X.k_scale` (its current ones) and `X.kv_scale` (the deprecated one of both); X is the
# attention block (model.layers.0.self_attn), its Attention layer `X.attn`. q / prob scales
# serve fp8 attention of the queries, which Kiln does not run: read, unused.
_SCALE_NAMES = tuple((re.compile(pattern + "$"), kind) for pattern, kind in (
    (r"\.attn\.(?P<kind>[qkv]|prob)_scale", None),
    (r"\.[kv]_proj\.(?P<kind>[kv])_scale", None),
    (r"\.qkv_proj\.(?P<kind>[kv])_scale", None),
    (r"(?<=\.self_attn)\.(?P<kind>[kv])_cache\.scale", None),
    (r"(?<=\.self_attn)\.q\.scale", "q"),
    (r"\.(?P<kind>[qkv])_proj\.output_scale", None), (r"\.prob_output_scale", "prob"),
    (r"\.(?P<kind>[qkv]|prob|kv)_scale", None),
))


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(the Attention module's name, which scale: k, v, q, prob or kv for both) for a
    checkpoint tensor holding a KV cache scale (_SCALE_NAMES); None: not a KV scale."""
    for pattern, kind in _SCALE_NAMES:
        match = pattern.search(name)
        if match is not None:
            return name[:match.start()] + ".attn", kind or match.group("kind")
    return None


# The --quantization methods whose attention layers read a checkpoint's KV scales: those vLLM
# gives its Attention layers a KV cache method (BaseKVCacheMethod) for: compressed-tensors, and
# online fp8 (Fp8Config, PTPCFp8Config). Kiln's online int8, which vLLM lacks, follows online fp8.
SCALE_READING_METHODS = ("compressed-tensors", "fp8", "ptpc_fp8", "int8")
# The caches vLLM warns about at scale 1.0 (its e4m3 ones; e5m2 runs unscaled by design)
_E4M3_CACHES = ("fp8", "fp8_e4m3")


def reads_checkpoint_scales(quantization: str | None) -> bool:
    """Whether a model running with `quantization` (its resolved method, None: unquantized)
    reads the checkpoint's KV cache scales into its attention layers."""
    return quantization in SCALE_READING_METHODS


def default_scale_warning(cache_dtype: str, unscaled: int, layers: int,
                          quantization_config) -> str | None:
    """The warning for `unscaled` of the model's `layers` attention layers that read checkpoint
    scales and got none, whose `cache_dtype` cache then runs at scale 1.0 (vLLM's
    BaseKVCacheMethod warns so, once); None when there is nothing to warn about."""
    if unscaled == 0 or cache_dtype not in _E4M3_CACHES:
        return None
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict() if quantization_config else {}
    asked = ("the checkpoint's quantization_config asks for an fp8 KV cache (kv_cache_scheme)"
             if quantization_config.get("kv_cache_scheme") else
             f"--kv-cache-dtype {cache_dtype} runs an fp8 KV cache")
    return (f"{asked} but the checkpoint has no k_scale / v_scale for {unscaled} of its {layers} "
            "attention layer(s): those use the default scale 1.0, which may cost accuracy (K/V "
            "values beyond e4m3's range saturate, small ones lose precision). Calibrate per-layer "
            "scales with llm-compressor (a recipe with a kv_cache_scheme, saved with the model)")


def unread_scales_warning(unread: list[str], quantization: str | None) -> str:
    """The warning for KV scale tensors a model running `quantization` does not read
    (reads_checkpoint_scales): vLLM finds no k_scale parameter in such a model and skips them
    with a warning (maybe_remap_kv_scale_name), so an fp8 cache runs at 1.0."""
    method = f"quantization {quantization!r}" if quantization else "no quantization_config"
    more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
    return (f"the checkpoint holds KV cache scale tensors ({unread[0]}{more}), but with {method} "
            "they are not loaded (as vLLM skips them: only a compressed-tensors or fp8 "
            "quantization config reads them); an fp8 KV cache runs at scale 1.0. To use them, "
            "give config.json a compressed-tensors quantization_config with a kv_cache_scheme, "
            "as llm-compressor writes with the scales")


def unplaced_scales_warning(unplaced: list[tuple[str, str]]) -> str:
    """The warning for KV scale tensors whose attention layer the model lacks (vLLM skips them
    with a warning too): (tensor, the layer it would go to) pairs, the first few named."""
    shown = ", ".join(f"{n} (for {m})" for n, m in unplaced[:4])
    more = f" and {len(unplaced) - 4} more" if len(unplaced) > 4 else ""
    return (f"{len(unplaced)} KV cache scale tensor(s) of the checkpoint name an attention layer "
            f"this model does not have, and are not loaded: {shown}{more}")


def checkpoint_cache_dtype(requested: str, quantization_config) -> str:
    """The KV cache dtype for --kv-cache-dtype `requested` over a checkpoint with this
    quantization_config (None: a float one): a compressed-tensors kv_cache_scheme makes "auto"
    fp8 (e4m3, the scales' format), as vLLM's Attention layers do for one, so the checkpoint's
    scales are used; any other request stays (fp8_e5m2 is refused with the scheme)."""
    if requested != "auto" or quantization_config is None:
        return requested
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    if (quantization_config.get("quant_method") == "compressed-tensors"
            and quantization_config.get("kv_cache_scheme")):
        return "fp8"
    return requested


def checkpoint_scale(name: str, tensor: torch.Tensor) -> float:
    """A checkpoint's KV cache scale as a float: one value (per tensor), finite and > 0; else
    refused naming the tensor."""
    if tensor.numel() != 1:
        raise ConfigError(f"checkpoint tensor {name} has shape {list(tensor.shape)}: Kiln's fp8 "
                          "KV cache takes one scale per layer (a per-tensor kv_cache_scheme, "
                          "strategy 'tensor'); per-head or per-channel scales are not supported")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"checkpoint tensor {name} is {value}: a KV cache scale must be finite "
                          "and > 0 (the cache stores x / scale); fix the checkpoint's scale")
    return value


def effective_scales(cache_dtype: str, k_scale: float | None,
                     v_scale: float | None) -> tuple[float, float]:
    """The (k_scale, v_scale) a layer's cache runs with, from the checkpoint's (None: absent),
    as vLLM's BaseKVCacheMethod decides: 1.0 for a cache in the model dtype ("auto": the
    checkpoint's scales are read and not used), both loaded ones, one loaded (a single kv_scale)
    for both, neither 1.0."""
    if cache_dtype == "auto":
        return 1.0, 1.0
    if k_scale is None and v_scale is None:
        return 1.0, 1.0
    if k_scale is None or v_scale is None:
        one = k_scale if v_scale is None else v_scale
        return one, one
    return k_scale, v_scale
