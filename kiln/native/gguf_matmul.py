"""Python entry point of csrc/gguf_matmul.c: decode-step linears read straight from a GGUF file's
Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks on CPU (see cpu_gemm.py for when a layer takes
it; the layers reach it through the IR op gguf_linear's C++ kernel, `quantized_linear` runs it
directly: `kiln::gguf_matmul`), once csrc/gguf_layout.c has put them in the kernel's layout
(`kernel_blocks`).

At a few rows a linear is a pass over its weight, and Q4_1 blocks are 5.3x fewer bytes than
the float32 copy even with their scales widened to float32 (`kernel_blocks`); the row limits by
type and dtype, below, are where that stops paying. The kernel takes integer dot products
against x cut into int8 limbs, within a few times float32's rounding (csrc/gguf_int_dot.h).
"""
import functools

import torch

from kiln import envs
from kiln.native import build

TILE_ROWS = 8  # rows of x the kernel takes at a time; it goes through more in tiles of 8
# the types the kernel reads, by ggml type id
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_F32, _BF16 = torch.float32, torch.bfloat16
# Up to how many rows the blocks beat the dense weight's kernels (GEMV, oneDNN), by type and
# activation dtype: the crossovers measured on 2 cores (figures: docs/measurements.md).
_ROWS_WORTH_IT = {"Q4_0": {_F32: 64, _BF16: 16}, "Q4_1": {_F32: 64, _BF16: 16},
                  "Q8_0": {_F32: 48, _BF16: 16}, "Q4_K": {_F32: 64, _BF16: 16},
                  "Q5_K": {_F32: 64, _BF16: 16}, "Q6_K": {_F32: 48, _BF16: 8}}


def _info(qtype: int = 0) -> list[int]:
    """(vector code compiled in, block bytes, block values, kernel block bytes, group rows)."""
    return torch.ops.kiln.gguf_info(qtype)


def kernel_available() -> bool:
    """The kernels built, and built with their vector code (AVX-512): without it the float32
    kernels are faster."""
    return build.available() and _info()[0] == 1


def available() -> bool:
    """kernel_available(), and the kernels on (KILN_NATIVE_CPU_OPS)."""
    return envs.native_cpu_ops() and kernel_available()


@functools.cache
def rows_worth_it(dtype: torch.dtype, qtype: int) -> int:
    """The most rows of x in `dtype` for which blocks of `qtype` beat the dense weight (0:
    never)."""
    name = next((n for n, t in QTYPES.items() if t == qtype), None)
    if not available() or name is None:
        return 0
    return _ROWS_WORTH_IT[name].get(dtype, 0)


def float32_limbs() -> int:
    """The int8 limbs float32 x is cut into, by torch's float32 matmul precision
    (torch.set_float32_matmul_precision): 3 at "highest" (the default; within a few times
    float32's rounding), 2 at "high" or "medium" (to 2^-13 of each 32 values' largest, as
    bfloat16 x always is; 1.3-1.5x faster from 4 rows on)."""
    return 3 if torch.get_float32_matmul_precision() == "highest" else 2


def row_bytes(qtype: int, in_features: int, kernel_layout: bool = False) -> int:
    """Bytes of one output row of blocks, as the file stores them or in the kernel's layout."""
    _, block_bytes, block_values, kernel_block_bytes, _ = _info(qtype)
    return in_features // block_values * (kernel_block_bytes if kernel_layout else block_bytes)


def group_rows() -> int:
    """Output rows the kernel's layout holds a weight in groups of."""
    return _info()[4]


def kernel_shape(qtype: int, out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of a [out_features, in_features] weight's blocks in the kernel's layout: its rows
    rounded up to whole groups (the last one padded with zero rows), of kernel row bytes."""
    groups = -(-out_features // group_rows())
    return groups * group_rows(), row_bytes(qtype, in_features, kernel_layout=True)


def kernel_blocks(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    """The file's blocks `rows` (uint8 [out, row_bytes], as `serves` accepts them) in the layout
    the kernel reads (csrc/gguf_blocks.h): fp16 scales widened to float32 and K-quant blocks cut
    into 32-value ones once, here, instead of in every decode step, and interleaved in groups
    of 16 rows, the last one padded with zero rows: [`kernel_shape`], but not a row per row."""
    return torch.ops.kiln.gguf_to_kernel_layout(rows, qtype)


def serves(qtype: int, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rows` (uint8 [out, row_bytes], the blocks of `weight`) can stand in for the
    float32 `weight` [out, in] in this kernel."""
    out_features, in_features = weight.shape
    return (qtype in QTYPES.values() and available() and weight.dtype in build.DTYPES
            and in_features % _info(qtype)[2] == 0
            and rows.dtype == torch.uint8
            and rows.is_contiguous() and tuple(rows.shape) == (
                out_features, row_bytes(qtype, in_features)))


def quantized_linear(x: torch.Tensor, rows: torch.Tensor, qtype: int, out_features: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] with 1 or more rows @ the blocks' values^T (+ bias) -> [..., out_features],
    in x's dtype; `rows` in the kernel's layout (`kernel_blocks` of blocks `serves` accepted)."""
    return torch.ops.kiln.gguf_matmul(x, rows, qtype, out_features, bias, float32_limbs())
