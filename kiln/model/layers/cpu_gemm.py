"""CPU GEMMs on oneDNN-prepacked weights: the native implementation of the IR op linear
(`kiln::linear_native`) runs them, `prepack_for_cpu` packs.

On x86 CPUs a weight reordered once into oneDNN's blocked layout multiplies 2-3x faster than
aten's dense `linear` at serving batch sizes (measured: [32, 576] x [576, 3072] fp32, 2 cores,
0.6 ms vs 2.2 ms). The packed copy is attached to the dense weight, found by its address, so a
traced graph still carries only the ordinary weight (identical layers stay identical for the
compile cache) and the op finds the packed one at run time. Steps of one or two rows take the C
GEMV kernel on the dense weight instead (kiln/native/gemv.py), which reads the weights faster
than oneDNN does at that size. A weight loaded from a GGUF file in Q4_0, Q4_1, Q8_0, Q4_K, Q5_K
or Q6_K also keeps the file's blocks (`attach_gguf_blocks`): steps of a few rows (up to 8-64 by
type and dtype, gguf_matmul.rows_worth_it) read those instead, 5.3x fewer bytes than float32 for
Q4_1 (kiln/native/gguf_matmul.py). The choice per call is made in C++
(kiln/native/linear_op.py); without a C++ compiler nothing is attached and the layers keep
aten's linear.
"""
import torch
from torch import nn

from kiln import ir
from kiln.logger import init_logger
from kiln.native import gemv, gguf_matmul, linear_op

logger = init_logger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Batch-size hint for oneDNN's reorder; any number of rows works with the packed weight.
_BATCH_HINT = 32


def cpu_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the IR op linear runs the native kernel, and it can take a packed weight."""
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES
            and ir.linear.chosen(device.type, dtype) == "native"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and linear_op.available())


def prepack_for_cpu(model: nn.Module) -> int:
    """Pack the weight of every module that opts in (`supports_cpu_packing`); returns how many.

    Call once after the weights are loaded; weights must not move afterwards (a moved weight is
    simply not found and runs through aten again)."""
    count = 0
    for module in model.modules():
        if not getattr(module, "supports_cpu_packing", False):
            continue
        weight = module.weight
        if not cpu_packing_available(weight.device, weight.dtype):
            continue
        if not linear_op.attached(weight).packed:  # tied weights are packed once
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
            serves = gemv.serves(weight, getattr(module, "bias", None))
            linear_op.attach_packed(weight, packed, gemv.MAX_ROWS if serves else 0)
        count += 1
    if count:
        logger.info("packed %d linear weights for oneDNN CPU GEMMs", count)
    return count


def attach_gguf_blocks(weight: torch.Tensor, qtype: int, blocks: torch.Tensor) -> bool:
    """Keep `blocks` (uint8 [out, row_bytes], the GGUF blocks `weight` was dequantized from) for
    the small-batch kernel; False (nothing kept) when the kernel cannot read them for it, or they
    would not pay in its dtype."""
    if not (ir.linear.chosen(weight.device.type, weight.dtype) == "native"
            and linear_op.available()
            and gguf_matmul.serves(qtype, blocks, weight)):
        return False
    rows = gguf_matmul.rows_worth_it(weight.dtype, qtype)
    if rows == 0:  # they would never beat the dense weight in this dtype
        return False
    # torch's float32 matmul precision as the model loads sets how precisely float32 x is held
    linear_op.attach_blocks(weight, gguf_matmul.kernel_blocks(qtype, blocks), qtype, rows,
                            gguf_matmul.float32_limbs())
    return True
