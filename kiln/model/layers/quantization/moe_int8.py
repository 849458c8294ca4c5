"""W8A8 int8 experts: a FusedMoE's stacked weights as int8 with a float32 scale per expert and
output channel (the IR op fused_moe_int8 runs them), quantized on load or read from a
compressed-tensors checkpoint (llm-compressor writes each expert's linears as the dense ones).
"""
import torch
from torch import nn

from kiln.model.layers.fused_moe import FusedMoE

# The checkpoint names of an expert's gate / up / down linears (Mixtral's: w1 / w3 / w2).
QWEN_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def experts_to_int8(moe: FusedMoE, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                    | None = None) -> None:
    """Give `moe` int8 w13_weight / w2_weight and float32 w13_weight_scale [E, 2 I_rank] /
    w2_weight_scale [E, H] parameters: `weights` ({"w13": (q, scale), "w2": ...}), or empty
    ones for a checkpoint to fill (each filled per expert and part, as the float ones)."""
    for name in ("w13", "w2"):
        old = getattr(moe, f"{name}_weight")
        experts, rows, cols = old.shape
        q, scale = (weights or {}).get(name) or (
            torch.empty(experts, rows, cols, dtype=torch.int8, device=old.device),
            torch.empty(experts, rows, dtype=torch.float32, device=old.device))
        for suffix, tensor in (("weight", q), ("weight_scale", scale)):
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = moe.weight_loader
            param.shard_ids = old.shard_ids  # load_weights' check: every expert's part filled
            setattr(moe, f"{name}_{suffix}", param)


@torch.no_grad()
def quantize_experts(moe: FusedMoE) -> None:
    """Online: each expert's loaded float weights -> int8 per output channel, the dense path's
    rounding (quantize_weight_per_channel); the float copies are let go."""
    from kiln.model.layers.quantization.w8a8_int8 import quantize_weight_per_channel

    quantized = {}
    for name in ("w13", "w2"):
        w = getattr(moe, f"{name}_weight").data  # [E, N, K]
        experts, rows, cols = w.shape
        q, scale = quantize_weight_per_channel(w.reshape(experts * rows, cols))  # row by row
        quantized[name] = (q.reshape(experts, rows, cols), scale.reshape(experts, rows))
    experts_to_int8(moe, quantized)


def expert_checkpoint_names(model: nn.Module, module_name: str, moe: FusedMoE) -> list[str]:
    """The checkpoint module names of every expert linear `moe` (Kiln's `module_name`) holds:
    what a compressed-tensors config's targets and ignore list are matched against."""
    parts = getattr(model, "expert_checkpoint_parts", QWEN_EXPERT_PARTS)
    return [f"{module_name}.{e}.{part}" for e in range(moe.num_experts) for part in parts]
