"""The IR's attention op, `kiln::unified_attention`: the one opaque call a compiled graph makes per
layer (the graph is split there), writing the step's K/V into the paged cache and attending.

It finds its layer, KV cache and metadata in the forward context, so the graph stays step-free.
Its implementations are attention backends, which the layers take at construction from the
selection: `torch` (kiln/attention/torch_backend.py, the reference) and `native` (the CPU
backend: Kiln's paged-attention kernel, reached from the dispatcher in C++).
"""
import torch

from kiln.custom_ops import register_op
from kiln.ir.op import Implementation, define

# provider -> attention backend name (kiln/attention/backend.py)
BACKENDS = {"torch": "torch", "native": "cpu"}


def run_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              layer_name: str) -> None:
    """q [T, nh*hd], k, v [T, nkv*hd] (rows may be strided), out [T, nh*hd] (written: the
    caller owns it): the layer's k/v go into its cache at the step's slots, then out = causal
    softmax(q k^T * scale) v over each request's cached tokens (within the layer's sliding
    window, its scores soft-capped where the layer has a cap), by its backend. An MLA layer's q
    is [T, nh*(nope+rope)], k its cache rows, out [T, nh*v_head_dim] (mla_backend.py)."""
    from kiln.forward_context import get_forward_context

    context = get_forward_context()
    try:
        layer = context.no_compile_layers[layer_name]
    except KeyError:
        raise KeyError(f"attention layer {layer_name!r} is not in the forward context; was the "
                       "model built inside set_current_kiln_config() with this config?") from None
    layer.impl.forward(q, k, v, layer.kv_cache, context.layer_metadata(layer), out)


def _fake(q, k, v, out, layer_name) -> None:
    return None


def _examples(dtype, device):
    q = torch.empty(1, 64, dtype=dtype, device=device)
    return q, q, q, q, ""


SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, str layer_name) -> ()"
unified_attention = define("unified_attention", SCHEMA, run_layer, _fake, _examples,
                           kernel=run_layer)
# Its twin, where the op's C++ CPU kernel (kiln/native/csrc/unified_attention_op.cpp) sends back
# what it does not serve itself.
register_op("unified_attention_python", SCHEMA, run_layer, _fake)


def _native_supported(q, k, v, out, layer_name) -> bool:
    from kiln.native import build, paged_attention

    return (q.device.type == "cpu" and q.dtype in build.DTYPES
            and paged_attention.available())


# Either way a call goes through the op (on CPU its C++ kernel serves what the native backend
# planned, the rest comes back to run_layer); the provider picks the layers' backend.
unified_attention.register(Implementation("native", unified_attention.packet, _native_supported))
unified_attention.impls["torch"] = Implementation("torch", unified_attention.packet)
