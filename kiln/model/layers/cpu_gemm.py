"""What a CPU linear layer holds beside its dense weight for the native implementations of the IR
ops linear and gguf_linear: oneDNN's packed copy, a GGUF file's blocks, and the plan of which
serves how many rows; `prepack_for_cpu` packs, `attach_gguf_blocks` keeps the blocks, and
`linear_call` is the IR call for what the layer holds.

On x86 CPUs a weight reordered once into oneDNN's blocked layout multiplies 2-3x faster than
aten's dense `linear` at serving batch sizes (docs/measurements.md). Steps of one or two rows
take the C GEMV kernel on the dense weight instead (kiln/native/gemv.py), which reads the
weights faster than oneDNN does at that size. A weight loaded from a GGUF file in Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K or Q6_K also keeps the file's blocks: steps of a few rows (up to 8-64 by type
and dtype, gguf_matmul.rows_worth_it) read those instead, 5.3x fewer bytes than float32 for Q4_1
(kiln/native/gguf_matmul.py). They are the layer's buffers (`cpu_packed`, `cpu_blocks`,
`cpu_plan`, not saved; the blocks' ggml type is `cpu_qtype`), passed with its weight on every
call: a traced graph takes them as inputs like the weight, and the choice per call is made in
C++ (csrc/linear_op.cpp; kiln/ir/gguf.py says the rule). A layer holding blocks calls the IR op
gguf_linear, any other the IR op linear.
Without the native kernels nothing is held and the layers run aten's linear.
"""
from typing import NamedTuple

import torch
from torch import nn

from kiln import ir
from kiln.logger import init_logger
from kiln.native import build, gemv, gguf_matmul

logger = init_logger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Batch-size hint for oneDNN's reorder; any number of rows works with the packed weight.
_BATCH_HINT = 32
BUFFERS = ("cpu_packed", "cpu_blocks", "cpu_plan")
# cpu_plan: int64 [gemv_rows, block_rows, limbs] (see csrc/linear_op.cpp)
_GEMV_ROWS, _BLOCK_ROWS, _LIMBS = range(3)
# what linear_call reads off the layer (a change to any of them changes the call)
CALL_FIELDS = frozenset({"weight", "bias", *BUFFERS, "cpu_qtype"})


def init_cpu_forms(module: nn.Module) -> None:
    """Give a linear layer its (empty) CPU buffers; its forward passes them to its IR op."""
    for name in BUFFERS:
        module.register_buffer(name, None, persistent=False)
    module.cpu_qtype = 0


def linear_call(module: nn.Module, bias: torch.Tensor | None) -> tuple[ir.IrOp, tuple]:
    """(IR op, its arguments after x) that multiply x by the layer's weight (+ bias): gguf_linear
    on its blocks (with the dense and packed copies for larger row counts) when it holds
    blocks, else linear."""
    weight, packed, blocks, plan = (module.weight, module.cpu_packed, module.cpu_blocks,
                                    module.cpu_plan)
    if blocks is None:
        return ir.linear, (weight, bias, packed, plan)
    dense = None if weight.is_meta else weight  # let go (release_dense_copies)
    return ir.gguf_linear, (blocks, module.cpu_qtype, weight.shape[0], bias, dense, packed, plan)


class Held(NamedTuple):
    packed: bool  # a oneDNN-packed copy
    gemv_rows: int  # up to how many rows the GEMV kernel takes the weight (0: never)
    blocks: bool  # GGUF blocks
    qtype: int  # their ggml type id
    block_rows: int  # up to how many rows they serve (0: never)
    limbs: int  # float32 x's int8 limbs in their kernel (gguf_matmul.float32_limbs; 0: none)


def held(module: nn.Module) -> Held:
    """What the layer holds for the native kernel."""
    plan = getattr(module, "cpu_plan", None)
    p = plan.tolist() if plan is not None else [0, 0, 0]
    blocks = getattr(module, "cpu_blocks", None) is not None
    return Held(getattr(module, "cpu_packed", None) is not None, p[_GEMV_ROWS], blocks,
                getattr(module, "cpu_qtype", 0) if blocks else 0, p[_BLOCK_ROWS],
                p[_LIMBS] if blocks else 0)


def _plan(module: nn.Module) -> torch.Tensor:
    if module.cpu_plan is None:
        module.cpu_plan = torch.tensor([0, 0, 3], dtype=torch.int64)
    return module.cpu_plan


def cpu_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the IR op linear runs the native kernel, and it can take a packed weight."""
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES
            and ir.linear.chosen(device.type, dtype) == "native"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and build.available())


def prepack_for_cpu(model: nn.Module, only: set[int] | None = None) -> int:
    """Pack the weight of every module that opts in (`supports_cpu_packing`); returns how many.

    Call once after the weights are loaded and in their dtype: the packed copy (a oneDNN tensor,
    which `module.to` cannot convert) is the layer's, so a weight changed afterwards must be
    packed again: `only` (ids of weights) packs the modules of those weights alone (a weight
    update, kiln/worker/weight_update.py; the new copy replaces the buffer, which compiled
    graphs read off the layer on every call)."""
    count = 0
    packed_by_weight: dict[int, torch.Tensor] = {}  # tied weights are packed once
    for module in model.modules():
        if not (getattr(module, "supports_cpu_packing", False) and hasattr(module, "cpu_plan")):
            continue
        weight = module.weight
        if only is not None and id(weight) not in only:
            continue
        if not cpu_packing_available(weight.device, weight.dtype):
            continue
        if id(weight) not in packed_by_weight:
            packed_by_weight[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), _BATCH_HINT)
        module.cpu_packed = packed_by_weight[id(weight)]
        serves = gemv.serves(weight, getattr(module, "bias", None))
        _plan(module)[_GEMV_ROWS] = gemv.MAX_ROWS if serves else 0
        count += 1
    if count and only is None:
        logger.info("packed %d linear weights for oneDNN CPU GEMMs", count)
    return count


def release_dense_copies(model: nn.Module) -> int:
    """Let go of the dense weight of every layer whose blocks and packed copy serve every row
    count without it (the GEMV range, the one path that reads it, lies within the blocks'),
    unless another module reads it (a tied embedding that looks its rows up in the dense weight,
    not in the head's blocks: vocab_embedding.embed_from_head_blocks); returns the bytes freed.
    The weight stays as a meta tensor: its shape and dtype, no storage. Call after
    `prepack_for_cpu`; a GGUF model would otherwise hold each weight three times."""
    readers: dict[int, int] = {}
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
            if getattr(module, "table_blocks", None) is None:
                readers[id(param)] = readers.get(id(param), 0) + 1
    freed = 0
    for module in model.modules():
        if getattr(module, "cpu_blocks", None) is None or module.cpu_packed is None:
            continue
        weight = module.weight
        plan = held(module)
        if weight.is_meta or readers[id(weight)] > 1 or plan.gemv_rows > plan.block_rows:
            continue
        freed += weight.numel() * weight.element_size()
        meta = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                            requires_grad=False)
        for holder in holders[id(weight)]:  # a tie holds the storage too
            holder.weight = meta
    if freed:
        logger.info("let go of %.0f MB of dense weights that the GGUF blocks and packed copies "
                    "stand in for", freed / 1e6)
    return freed


def attach_gguf_blocks(module: nn.Module, qtype: int, blocks: torch.Tensor) -> bool:
    """Keep `blocks` (uint8 [out, row_bytes], the GGUF blocks the layer's weight was dequantized
    from) for the small-batch kernel; False (nothing kept) when the kernel cannot read them for
    it, or they would not pay in its dtype."""
    weight = module.weight
    if not (hasattr(module, "cpu_blocks")
            and ir.gguf_linear.chosen(weight.device.type, weight.dtype) == "native"
            and build.available() and gguf_matmul.serves(qtype, blocks, weight)):
        return False
    rows = gguf_matmul.rows_worth_it(weight.dtype, qtype)
    if rows == 0:  # they would never beat the dense weight in this dtype
        return False
    module.cpu_blocks = gguf_matmul.kernel_blocks(qtype, blocks)
    module.cpu_qtype = qtype
    plan = _plan(module)
    plan[_BLOCK_ROWS] = rows
    # torch's float32 matmul precision as the model loads sets how precisely float32 x is held
    plan[_LIMBS] = gguf_matmul.float32_limbs()
    return True
