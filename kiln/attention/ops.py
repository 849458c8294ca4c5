"""The `kiln::unified_attention` custom op: the one opaque call a compiled graph makes per layer.

It finds its layer, KV cache and metadata in the forward context, so the graph stays step-free.
"""
import torch

from kiln.custom_ops import register_op
from kiln.forward_context import get_forward_context


def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      layer_name: str) -> None:
    context = get_forward_context()
    try:
        layer = context.no_compile_layers[layer_name]
    except KeyError:
        raise KeyError(f"attention layer {layer_name!r} is not in the forward context; was the "
                       "model built inside set_current_kiln_config() with this config?") from None
    layer.impl.forward(q, k, v, layer.kv_cache, context.attn_metadata, out)


def _unified_attention_fake(q, k, v, out, layer_name) -> None:
    return None


_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, str layer_name) -> ()"
register_op("unified_attention", _SCHEMA, unified_attention, _unified_attention_fake)
# The same, for the C++ CPU kernel of unified_attention (kiln/native/csrc/attention_op.cpp) to
# send back what it does not serve itself.
register_op("unified_attention_python", _SCHEMA, unified_attention, _unified_attention_fake)
