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
from kiln.lora.adapter import ALL_TARGETS, targets_for
from kiln.model.layers.linear import QKVParallelLinear, RowParallelLinear, take_shard

_SUBCLASSES: dict[type, type] = {}


class LoRALayerMixin:
    """forward: the base layer's output + the token's adapter delta (zero for slot -1)."""

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return ir.lora_add(x, out, self.lora_a, self.lora_b, self.lora_indices[:x.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, super().forward(x))


class LoRARowParallelMixin(LoRALayerMixin):
    """A row-parallel layer (o_proj, down_proj): A holds this rank's input columns, so the
    delta is this rank's share of it and joins the partial sum before the all-reduce (vLLM's
    RowParallelLinearWithLoRA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RowParallelLinear.forward(self, x)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, super().partial_sum(x))


def _lora_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        mixin = LoRARowParallelMixin if issubclass(cls, RowParallelLinear) else LoRALayerMixin
        _SUBCLASSES[cls] = type(f"LoRA{cls.__name__}", (mixin, cls), {})
    return _SUBCLASSES[cls]


def slice_sizes(layer: nn.Module, layer_name: str) -> list[int]:
    """This rank's output sizes of a fused layer's slices (q, k, v / gate, up), or its one
    output (a row-parallel layer's is whole)."""
    if layer_name.endswith("qkv_proj"):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if layer_name.endswith("gate_up_proj"):
        return [size // layer.tp_size for size in layer.output_sizes]
    return [layer._out_local()]  # a column-parallel layer's rows (Phi's fc1), else all


def rank_shard(layer: nn.Module, part: int, a: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [r, in], B [out, r]) of one adapter module on `layer` (slice `part` of
    a fused one), split as the layer's weight is: a column-parallel layer's B by output rows
    (K/V by KV head, replicated where ranks outnumber them), a row-parallel one's A by input
    columns; the other stays whole."""
    size, rank = layer.tp_size, layer.tp_rank
    if size == 1:
        return a, b
    if isinstance(layer, RowParallelLinear):
        local = a.shape[1] // size
        return take_shard(a, 1, rank, local, size), b
    if isinstance(layer, QKVParallelLinear) and part > 0:
        shards = size // layer.kv_replicas
        return a, take_shard(b, 0, rank // layer.kv_replicas, layer.kv_size, shards)
    local = layer.q_size if isinstance(layer, QKVParallelLinear) else b.shape[0] // size
    return a, take_shard(b, 0, rank, local, size)


def attach(model: nn.Module, max_loras: int, max_rank: int, indices: torch.Tensor,
           dtype: torch.dtype) -> dict[tuple[int, str], nn.Module]:
    """Give every decoder layer's projections an adapter may target (q/k/v/o, gate/up/down;
    Phi's q/k/v, dense, fc1 / fc2) their LoRA buffers (this rank's shard under tensor
    parallelism); returns (layer index, Kiln layer name) -> layer. `indices`: the shared
    per-token slot buffer."""
    layers = {}
    fused = sorted({name for name, _ in targets_for(model.config).values()})
    for index, decoder in enumerate(model.model.layers):
        for name in fused:
            layer = decoder.get_submodule(name)
            sizes = slice_sizes(layer, name)
            # this rank's input width, from the sizes (a quantized weight's may differ)
            fan_in = layer._in_local()
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
    """Put `adapter` (kiln.lora.adapter.LoRAAdapter) in `slot` of every layer, this rank's
    shard of it; modules it does not target get zeros there."""
    for layer in layers.values():
        layer.lora_a[slot].zero_()
        layer.lora_b[slot].zero_()
    for (index, module), (a, b) in adapter.weights.items():
        name, part = ALL_TARGETS[module]
        layer = layers[(index, name)]
        a, b = rank_shard(layer, part, a, b)
        rows = slice(part * max_rank, part * max_rank + a.shape[0])
        start = sum(layer.lora_slices[:part])
        layer.lora_a[slot, rows].copy_(a)
        layer.lora_b[slot, rows, start:start + b.shape[0]].copy_(b.t())
