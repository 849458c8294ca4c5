"""The IR's LoRA op, `kiln::lora_add`: a linear layer's output plus each token's adapter delta,
punica-style: every adapter slot stacked in one tensor and a per-token slot index, both runtime
inputs, so one compiled graph serves any mix of adapters (kiln/lora/).

Providers: the torch reference (every slot for every token, trace-friendly) and, on CPU, a
by-slot kernel (`native`) that computes only the slots the batch uses: the model runner
publishes them once per step (publish_step_slots), not read back per projection per layer.
"""
import weakref

import torch

from kiln.custom_ops import register_op
from kiln.ir.op import Implementation, define


def _lora_add_ref(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [T, in], base [T, out] (the layer's output), lora_a [S, R, in], lora_b [S, R, out]
    (B^T, scaling folded in; a fused layer's slices as a block-diagonal R), indices int64 [T]
    (slot of each token's adapter, -1: none) -> base + (x @ A_s^T) @ B_s^T per token, s its
    slot. Written as two dense matmuls over every slot with the other slots' columns masked
    out: no data-dependent shapes, nothing to break a trace. The adapters' dtype
    (--lora-dtype) may differ from the model's: the delta is computed in theirs."""
    slots, rank, fan_in = lora_a.shape
    xa = x.to(lora_a.dtype) @ lora_a.reshape(slots * rank, fan_in).t()  # [T, S*R]
    column_slot = torch.arange(slots * rank, device=x.device) // rank
    mask = (indices.unsqueeze(1) == column_slot.unsqueeze(0)).to(xa.dtype)
    delta = (xa * mask) @ lora_b.reshape(slots * rank, lora_b.shape[-1])  # [T, out]
    return base + delta.to(base.dtype)


# The step's slots per per-token slot buffer (keyed by its data pointer; dropped when the
# buffer goes, so a later tensor at that address is never mistaken for it): (the slots its
# tokens use, sorted; how many tokens from the first all use the one slot, else 0).
_STEP_SLOTS: dict[int, tuple[list[int], int]] = {}


def publish_step_slots(buffer: torch.Tensor, slots: list[int], uniform: int) -> None:
    """What the model runner just wrote into `buffer` (the per-token slot indices the LoRA
    layers read, from its start): the `slots` its tokens use, and `uniform`, the number of
    tokens from the first that all use slots[0] (0 where they are mixed). Once per step, in
    place of a host read of the indices in every projection of every layer."""
    key = buffer.data_ptr()
    if key not in _STEP_SLOTS:
        weakref.finalize(buffer, _STEP_SLOTS.pop, key, None)
    _STEP_SLOTS[key] = (sorted(slots), uniform)


def _slots_used(indices: torch.Tensor) -> tuple[list[int], bool]:
    """(the adapter slots `indices` uses, sorted; whether its tokens' slots differ, no adapter
    (-1) counting as one): as published for the step where `indices` is the runner's buffer
    (a slice from its start), else read from the tensor."""
    known = _STEP_SLOTS.get(indices.data_ptr())
    if known is not None:
        slots, uniform = known
        return slots, not (len(slots) == 1 and indices.shape[0] <= uniform)
    used = torch.unique(indices).tolist()  # sorted: -1 (no adapter) first
    return [s for s in used if s >= 0], len(used) > 1


def _lora_add_by_slot(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The reference's result with work for the slots present only: per slot some token uses,
    x through its A (a view: no copy of the weights), masked to its tokens, through its B
    into one delta (the slots present are the step's, published by the model runner, else
    read on the host: an opaque op in a graph, CPU only)."""
    slots, mixed = _slots_used(indices)
    if not slots:
        return base.clone()
    xin = x.to(lora_a.dtype)
    delta = None  # [T, out]
    for slot in slots:
        xa = xin @ lora_a[slot].t()  # [T, R]
        if mixed:  # other tokens' rows to zero (none to mask when one slot is all)
            xa = xa * (indices == slot).unsqueeze(1).to(xa.dtype)
        delta = xa @ lora_b[slot] if delta is None else delta.addmm_(xa, lora_b[slot])
    return base + delta.to(base.dtype)


def _lora_add_fake(x, base, lora_a, lora_b, indices):
    return torch.empty_like(base)


def _examples(dtype: torch.dtype, device: str):
    return (torch.randn(2, 64, dtype=dtype, device=device),
            torch.randn(2, 32, dtype=dtype, device=device),
            torch.randn(2, 8, 64, dtype=dtype, device=device),
            torch.randn(2, 8, 32, dtype=dtype, device=device),
            torch.tensor([0, -1], device=device))


_SCHEMA = "(Tensor x, Tensor base, Tensor lora_a, Tensor lora_b, Tensor indices) -> Tensor"
lora_add = define("lora_add", _SCHEMA, _lora_add_ref, _lora_add_fake, _examples)
register_op("lora_add_by_slot", _SCHEMA, _lora_add_by_slot, _lora_add_fake)
lora_add.register(Implementation(
    "native", _lora_add_by_slot, lambda x, *args: x.device.type == "cpu",
    graph_op=torch.ops.kiln.lora_add_by_slot.default))
