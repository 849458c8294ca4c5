"""W8A8 int8 linear layers: int8 weights with a float32 scale per output channel, activations
quantized per token at run time (dynamic, symmetric), the GEMM in int8 with int32 sums.

`Int8W8A8Config.prepare(model)` gives the targeted linears int8 parameters before a
compressed-tensors checkpoint loads into them; `quantize_loaded(model)` (online, `--quantization
int8`) quantizes float weights already loaded, then packs every int8 weight into VNNI panels on
CPUs whose GEMM reads them so (kiln/ir/int8_panels.py; the weight as stored is let go).
Embeddings, the LM head and a classifier's score head stay in the model dtype.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.ir import int8_panels
from kiln.ir import quant as ir_quant
from kiln.logger import init_logger
from kiln.model.layers.cpu_gemm import BUFFERS
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.linear import LinearBase, check_scale
from kiln.model.layers.moe_cpu import pack_int8_experts
from kiln.model.layers.quantization.moe_int8 import (
    expert_checkpoint_names,
    experts_to_int8,
    quantize_experts,
)

logger = init_logger(__name__)

# Kiln's merged linears and the checkpoint names of their parts (what `ignore` lists).
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj")}


class Int8LinearMethod:
    """How a converted linear computes: quantize x per token, int8 GEMM, scales, bias."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = ir_quant.dynamic_int8_quant(x)  # [T, K] int8, [T, 1] float32
        if layer.weight_panels is not None:
            return int8_panels.int8_scaled_mm_panels(q, scale, layer.weight_panels,
                                                     layer.weight_scale, bias, x.dtype)
        return ir_quant.int8_scaled_mm(q, scale, layer.weight, layer.weight_scale, bias, x.dtype)


def int8_weight(layer: LinearBase) -> torch.Tensor:
    """The layer's int8 weight [N, K], from its panels where it was packed."""
    if layer.weight_panels is None:
        return layer.weight
    return int8_panels.unpack_int8_panels(layer.weight_panels, layer.weight_scale.numel())


def pack_for_cpu(layer: LinearBase) -> bool:
    """Pack the layer's int8 weight into panels where this CPU's GEMM reads it so
    (int8_ops.packs_weights) and the panel op's native kernel is chosen, letting the weight as
    stored go (a meta tensor keeps its shape)."""
    from kiln.native import int8_ops

    w = layer.weight
    if w.is_meta or layer.weight_panels is not None or not int8_ops.packs_weights(w.shape[1],
                                                                                 w.device):
        return False
    # only for the panel kernel: the op's torch reference (KILN_NATIVE_CPU_OPS=0, or a priority
    # naming torch for int8_scaled_mm_panels) would unpack the whole weight on every call. The
    # selection is applied before loading; the dtype only matters where none was.
    if int8_panels.int8_scaled_mm_panels.chosen(w.device.type, torch.float32) != "native":
        return False
    layer.weight_panels = int8_panels.pack_int8_panels(w.data)
    layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                requires_grad=False)
    return True


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], scale float32 [N]): the activations' symmetric rounding,
    per output channel (what online `quantization="int8"` stores)."""
    q, scale = ir_quant.dynamic_int8_quant.reference(w)
    return q, scale.reshape(-1)


def _scale_loader(layer: LinearBase):
    def load(param, loaded: torch.Tensor, shard_id=None) -> None:
        # compressed-tensors stores [N, 1] in the model dtype; Kiln keeps [N] float32, sharded
        # as the weight's rows are (a row-parallel layer's scales are whole, like a bias).
        check_scale(loaded)
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        if shard_id is None:
            layer.weight_loader(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard_id)
    return load


def to_int8(layer: LinearBase, weight: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> None:
    """Give `layer` int8 `weight` [N, K] and float32 `weight_scale` [N] parameters (empty ones,
    for a checkpoint to load, when not given) and the int8 method."""
    n, k = layer.weight.shape
    device = layer.weight.device
    w = nn.Parameter(weight if weight is not None else
                     torch.empty(n, k, dtype=torch.int8, device=device), requires_grad=False)
    s = nn.Parameter(scale if scale is not None else
                     torch.empty(n, dtype=torch.float32, device=device), requires_grad=False)
    w.weight_loader = layer.weight_loader
    s.weight_loader = _scale_loader(layer)
    layer.weight = w
    layer.weight_scale = s
    layer.quant_method = Int8LinearMethod()
    layer.supports_cpu_packing = False  # oneDNN's float packing does not apply
    for name in BUFFERS:  # nor do the float weight's packed copy or GGUF blocks
        setattr(layer, name, None)
    layer.register_buffer("weight_panels", None, persistent=False)  # pack_for_cpu


def _holds_part(model: nn.Module) -> bool:
    """Whether `model` is one pipeline stage's part of the model (others hold the rest)."""
    from kiln.distributed.pipeline import PPMissingLayer

    return any(isinstance(m, PPMissingLayer) for m in model.modules())


def checkpoint_module_name(model: nn.Module, name: str) -> str:
    """Kiln module `name` as the checkpoint names it (Mixtral's `mlp` is its
    `block_sparse_moe`): what an ignore list's patterns are written against."""
    rename = getattr(model, "checkpoint_module_name", None)
    return rename(name) if rename is not None else name


@dataclass
class Int8W8A8Config:
    online: bool  # quantize float weights on load (else: a compressed-tensors checkpoint)
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=list)

    def layers(self, model: nn.Module) -> list[tuple[str, LinearBase]]:
        """The linears this config quantizes, by module name."""
        # a model whose checkpoint stores them fused (Phi-3) names them as Kiln does
        fused = getattr(model, "fused_checkpoint_modules", ())

        def parts(module_name: str) -> list[str]:
            prefix, _, leaf = module_name.rpartition(".")
            return [] if leaf in fused else [f"{prefix}.{p}" for p in MERGED_PARTS.get(leaf, ())]

        chosen = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            if self.online and not module.online_quantization:
                continue  # an MoE router, a classifier's score head
            if not self.online and not self._stored_quantized(model, name, parts):
                continue
            chosen.append((name, module))
        return chosen

    def _stored_quantized(self, model: nn.Module, name: str, parts_of) -> bool:
        """Whether Kiln module `name` is stored quantized (`parts_of(module name)`: the
        checkpoint names of a merged linear's parts, else []). Where the checkpoint's name
        differs from Kiln's (Mixtral's `block_sparse_moe`), an ignore list written against
        Kiln's, which is transformers 5's (`model.layers.0.mlp.gate`, as llm-compressor
        run under it names the router), leaves the module float too."""
        from kiln.model.layers.quantization.compressed_tensors import ignored, is_quantized

        stored = checkpoint_module_name(model, name)
        stored_parts = parts_of(stored)
        # a refusal names Kiln's module, and its parts as stored
        if not is_quantized(name if stored_parts else stored, stored_parts, self.targets,
                            self.ignore):
            return False
        return stored == name or not all(ignored(n, self.ignore) for n in parts_of(name) or [name])

    def expert_layers(self, model: nn.Module) -> list[FusedMoE]:
        """The stacked experts this config quantizes: all online; a checkpoint's where it
        quantized every expert linear (some, not all: refused, they run as one op)."""
        return [m for name, m in model.named_modules() if isinstance(m, FusedMoE) and (
            self.online or self._stored_quantized(
                model, name, lambda module_name, m=m: expert_checkpoint_names(model, module_name, m)))]

    def prepare(self, model: nn.Module) -> int:
        """Before loading a quantized checkpoint: int8 parameters for it to fill."""
        if self.online:
            return 0
        chosen, experts = self.layers(model), self.expert_layers(model)
        # a checkpoint of int8 tensors read as all float; a pipeline stage holds some layers
        # only, which may all be ignored while another stage's are not
        if not chosen and not experts and not _holds_part(model):
            from kiln.model.layers.quantization.compressed_tensors import UnsupportedQuantization

            raise UnsupportedQuantization(
                f"quantization_config.config_groups targets={self.targets!r} (ignore="
                f"{self.ignore!r}) select no linear layer of this model; target 'Linear', "
                "its module names or 're:' patterns over them")
        for _, layer in chosen:
            to_int8(layer)
        for moe in experts:
            experts_to_int8(moe)
        logger.info("W8A8 int8: %d linear layers%s load int8 weights (compressed-tensors)",
                    len(chosen), f" and {len(experts)} expert stacks" if experts else "")
        return len(chosen)

    @torch.no_grad()
    def quantize_loaded(self, model: nn.Module) -> int:
        """Online: each linear's loaded float weight -> int8 per channel (the float copy and
        anything attached to it, such as GGUF blocks, are freed). Then, online or not, every
        int8 weight goes into panels where this CPU reads it so. The layers quantized here."""
        chosen = self.layers(model) if self.online else []
        for _, layer in chosen:
            q, scale = quantize_weight_per_channel(layer.weight.data)
            to_int8(layer, q, scale)
        experts = self.expert_layers(model) if self.online else []
        for moe in experts:  # per expert and output channel
            quantize_experts(moe)
        if chosen:
            logger.info("W8A8 int8: quantized %d linear layers%s on load", len(chosen),
                        f" and {len(experts)} expert stacks" if experts else "")
        packed = sum(pack_for_cpu(m) for m in model.modules()
                     if isinstance(m, LinearBase) and isinstance(m.quant_method, Int8LinearMethod))
        packed += 2 * sum(pack_int8_experts(m) for m in model.modules()
                          if isinstance(m, FusedMoE))
        if packed:
            logger.info("W8A8 int8: packed %d weights into VNNI panels", packed)
        return len(chosen)
