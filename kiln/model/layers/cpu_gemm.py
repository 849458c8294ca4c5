"""CPU GEMMs on oneDNN-prepacked weights: `kiln::linear` runs them, `prepack_for_cpu` packs.

On x86 CPUs a weight reordered once into oneDNN's blocked layout multiplies 2-3x faster than
aten's dense `linear` at serving batch sizes (measured: [32, 576] x [576, 3072] fp32, 2 cores,
0.6 ms vs 2.2 ms). The packed copy is kept beside the dense weight, keyed by the dense weight's
address, so a traced graph still carries only the ordinary weight (identical layers stay
identical for the compile cache) and the op finds the packed one at run time. Steps of one or
two rows take the C GEMV kernel on the dense weight instead (kiln/native/gemv.py), which reads
the weights faster than oneDNN does at that size. A weight loaded from a GGUF file in Q4_0,
Q4_1, Q8_0, Q4_K or Q6_K also keeps the file's blocks (`attach_gguf_blocks`): steps of a few
rows (2 to 8 by type and dtype, gguf_matmul.rows_worth_it) read those instead, 6.4x fewer bytes
than float32 for Q4_1 (kiln/native/gguf_matmul.py).
"""
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kiln.custom_ops import register_op
from kiln.logger import init_logger
from kiln.native import gemv, gguf_matmul

logger = init_logger(__name__)

# dense weight data_ptr -> (oneDNN-packed weight, whether the GEMV kernel serves it)
_PACKED: dict[int, tuple[torch.Tensor, bool]] = {}
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# dense weight data_ptr -> (ggml type id, the GGUF blocks [out, row_bytes] uint8, the most
# rows they take: gguf_matmul.rows_worth_it for the weight's dtype, decided once)
_GGUF_BLOCKS: dict[int, tuple[int, torch.Tensor, int]] = {}
# Batch-size hint for oneDNN's reorder; any number of rows works with the packed weight.
_BATCH_HINT = 32


def packed_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    ptr = weight.data_ptr()
    blocks = _GGUF_BLOCKS.get(ptr)
    if (blocks is not None and x.dtype == weight.dtype
            and 0 < x.numel() <= blocks[2] * x.shape[-1]
            and (bias is None or bias.is_contiguous() and bias.dtype == x.dtype)):
        return gguf_matmul.quantized_linear(x, blocks[1], blocks[0], weight.shape[0], bias)
    entry = _PACKED.get(ptr)
    if entry is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    packed, gemv_serves = entry
    shape = x.shape
    # Per call only what can change between calls: the row count (and, rarely, the bias).
    if (gemv_serves and 0 < x.numel() <= gemv.MAX_ROWS * shape[-1]
            and (bias is None or bias.is_contiguous() and bias.dtype == x.dtype)):
        return gemv.skinny_linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none",
                                              [], "")
    return out.view(*shape[:-1], weight.shape[0])


def _packed_linear_fake(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register_op("linear", "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", packed_linear,
            _packed_linear_fake)


def cpu_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_reorder_linear_weight"))


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
        ptr = weight.data_ptr()
        if ptr not in _PACKED:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
            _PACKED[ptr] = (packed, gemv.serves(weight, getattr(module, "bias", None)))
            # The address is reused once the weight is freed: forget the packed copy with it.
            weakref.finalize(weight, _PACKED.pop, ptr, None)
        module.use_packed_gemm = True
        count += 1
    if count:
        logger.info("packed %d linear weights for oneDNN CPU GEMMs", count)
    return count


def attach_gguf_blocks(weight: torch.Tensor, qtype: int, blocks: torch.Tensor) -> bool:
    """Keep `blocks` (uint8 [out, row_bytes], the GGUF blocks `weight` was dequantized from) for
    the small-batch kernel; False (nothing kept) when the kernel cannot read them for it."""
    if not gguf_matmul.serves(qtype, blocks, weight):
        return False
    ptr = weight.data_ptr()
    _GGUF_BLOCKS[ptr] = (qtype, blocks, gguf_matmul.rows_worth_it(weight.dtype, qtype))
    weakref.finalize(weight, _GGUF_BLOCKS.pop, ptr, None)  # the address is reused once freed
    return True
