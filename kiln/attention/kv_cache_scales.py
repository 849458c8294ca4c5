"""An fp8 KV cache's per-layer scales from a checkpoint (vLLM's k_scale / v_scale): the checkpoint
tensor names that carry them, their checks, and the scales a layer runs with.

A cache stores x / scale (rounded to fp8) and reads back stored * scale; a scale of 1.0 is the
plain cast. They are scalars per layer (vLLM's per-tensor case); anything else is refused.
"""
import math

import torch

from kiln.errors import ConfigError

# checkpoint name suffix (after the attention block's prefix, e.g. model.layers.0.self_attn)
# -> the scale it holds. llm-compressor wrote k/v_proj.output_scale, later self_attn.k_scale;
# vLLM names them self_attn.attn.k_scale; `kv_scale` is the deprecated single scale of both.
# q / prob scales serve fp8 attention of the queries, which Kiln does not run: read, unused.
_SUFFIXES = (
    (".attn.k_scale", "k"), (".attn.v_scale", "v"), (".attn.q_scale", "q"),
    (".attn.prob_scale", "prob"),
    (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"), (".q_proj.output_scale", "q"),
    (".k_scale", "k"), (".v_scale", "v"), (".q_scale", "q"), (".prob_scale", "prob"),
    (".kv_scale", "kv"),
)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(the Attention module's name, which scale) for a checkpoint tensor holding a KV cache
    scale, as vLLM remaps it (maybe_remap_kv_scale_name): `X.k_proj.output_scale`,
    `X.k_scale` and `X.attn.k_scale` are all module `X.attn`'s k scale. None: not a KV scale."""
    for suffix, kind in _SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)] + ".attn", kind
    return None


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
