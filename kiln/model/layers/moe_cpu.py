"""What a CPU FusedMoE holds for the native int8 MoE kernels (kiln/ir/moe_native.py): its int8
experts in VNNI panels, packed once after loading, the int8 stacks let go (w8a8_int8.quantize_loaded).
Float experts hold nothing more: their native kernel runs on the stacks as stored
(csrc/moe_experts.cpp), so no second copy of them is kept.
"""
import torch

from kiln import ir
from kiln.ir.moe_int8_panels import pack_expert_panels
from kiln.native import int8_ops


def pack_int8_experts(moe) -> bool:
    """Pack int8 experts into panels (`w13_panels`, `w2_panels`) where this CPU's int8 GEMM reads
    them so (both weights' K a multiple of 4) and fused_moe_int8_panels runs the native kernel
    (its reference would unpack every expert on every call); the int8 stacks become meta tensors
    (their shapes kept). False where nothing was packed."""
    from torch import nn

    w13, w2 = moe.w13_weight, moe.w2_weight
    if (moe.w13_weight_scale is None or w13.is_meta or moe.w13_panels is not None
            or not (int8_ops.packs_weights(w13.shape[2], w13.device)
                    and int8_ops.packs_weights(w2.shape[2], w2.device))
            # the selection is applied before loading; the dtype only matters where none was
            or ir.fused_moe_int8_panels.chosen(w13.device.type, torch.float32) != "native"):
        return False
    moe.w13_panels = pack_expert_panels(w13.data)
    moe.w2_panels = pack_expert_panels(w2.data)
    for name, w in (("w13_weight", w13), ("w2_weight", w2)):
        meta = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        meta.weight_loader, meta.shard_ids = w.weight_loader, w.shard_ids
        setattr(moe, name, meta)
    return True


def int8_expert_weight(moe, name: str) -> torch.Tensor:
    """The int8 stack `name` ("w13" or "w2") [E, N, K], from its panels where it was packed."""
    from kiln.ir.moe_int8_panels import unpack_expert_panels

    panels = getattr(moe, f"{name}_panels")
    if panels is None:
        return getattr(moe, f"{name}_weight")
    return unpack_expert_panels(panels, getattr(moe, f"{name}_weight_scale").shape[1])
