"""The GEMV kernel (csrc/gemv.c) `kiln::linear_native` (csrc/linear_op.cpp) uses for decode steps
of one or two rows, and which weights it can take; `kiln::gemv` runs it alone.

There a linear is a pass over its weight; this kernel streams the dense weight at close to memory
bandwidth, faster than oneDNN at that size (docs/measurements.md).
"""
import torch

from kiln import envs
from kiln.native import build

# Up to this many rows the kernel wins; from 4 rows on oneDNN's packed GEMM did when measured.
MAX_ROWS = 2


def available() -> bool:
    return build.available()


def serves(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when the kernel can run this CPU layer's steps of few rows: a contiguous weight (and
    bias) in a kernel dtype, the kernels on (KILN_NATIVE_CPU_OPS) and built. Decided once per
    layer, when its weight is packed, so a step checks only its row count."""
    return (weight.device.type == "cpu" and weight.dtype in build.DTYPES
            and weight.is_contiguous() and weight.dim() == 2 and weight.shape[1] > 0
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
            and envs.native_cpu_ops() and build.available())
