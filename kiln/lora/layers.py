"""LoRA on the model's fused projections: each targeted linear gets stacked adapter buffers
(max_loras slots) and adds `ir.lora_add`'s per-token delta to its output.

The layer's class is swapped for a subclass with that forward (its weights, loaders and IR
call are untouched), before the model is first called, so the traced graph holds the op with
the buffers as inputs; the buffers are written in place, so a compiled graph (and a CUDA graph)
keeps reading the current adapters.
"""
import torch
from torch import nn

from kiln import ir
from kiln.lora.adapter import TARGETS

_SUBCLASSES: dict[type, type] = {}


class LoRALayerMixin:
    """forward: the base layer's output + the token's adapter delta (zero for slot -1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return ir.lora_add(x, out, self.lora_a, self.lora_b, self.lora_indices[:x.shape[0]])


def _lora_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALayerMixin, cls), {})
    return _SUBCLASSES[cls]


def slice_sizes(layer: nn.Module, layer_name: str) -> list[int]:
    """The output sizes of a fused layer's slices (q, k, v / gate, up), or its one output."""
    if layer_name.endswith("qkv_proj"):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if layer_name.endswith("gate_up_proj"):
        return list(layer.output_sizes)
    return [layer.output_size]


def attach(model: nn.Module, max_loras: int, max_rank: int, indices: torch.Tensor,
           dtype: torch.dtype) -> dict[tuple[int, str], nn.Module]:
    """Give every decoder layer's q/k/v/o, gate/up/down projection its LoRA buffers; returns
    (layer index, fused layer name) -> layer. `indices`: the shared per-token slot buffer."""
    layers = {}
    fused = sorted({name for name, _ in TARGETS.values()})
    for index, decoder in enumerate(model.model.layers):
        for name in fused:
            layer = decoder.get_submodule(name)
            sizes = slice_sizes(layer, name)
            fan_in = layer.input_size  # (not the weight's: a quantized one's width may differ)
            device = indices.device
            rank = max_rank * len(sizes)
            layer.register_buffer("lora_a", torch.zeros(max_loras, rank, fan_in, dtype=dtype,
                                                        device=device), persistent=False)
            layer.register_buffer("lora_b", torch.zeros(max_loras, rank, sum(sizes), dtype=dtype,
                                                        device=device), persistent=False)
            layer.register_buffer("lora_indices", indices, persistent=False)
            layer.lora_slices = sizes
            layer.__class__ = _lora_class(type(layer))
            layers[(index, name)] = layer
    return layers


@torch.no_grad()
def write_slot(layers: dict, slot: int, adapter, max_rank: int) -> None:
    """Put `adapter` (kiln.lora.adapter.LoRAAdapter) in `slot` of every layer; modules it does
    not target get zeros there."""
    for layer in layers.values():
        layer.lora_a[slot].zero_()
        layer.lora_b[slot].zero_()
    for (index, module), (a, b) in adapter.weights.items():
        name, part = TARGETS[module]
        layer = layers[(index, name)]
        rows = slice(part * max_rank, part * max_rank + a.shape[0])
        start = sum(layer.lora_slices[:part])
        layer.lora_a[slot, rows].copy_(a)
        layer.lora_b[slot, rows, start:start + b.shape[0]].copy_(b.t())
