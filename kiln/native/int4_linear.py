"""Python entry point of csrc/ops_int4.cpp (the `native` int4_weight_linear over the canonical int4
layout, csrc/int4_linear.c) and the pure decision of which arguments it takes.
"""
import functools

import torch

from kiln.native import build

# Scale dtypes the kernel reads (checkpoints store bfloat16 or float16 scales; Kiln keeps them so).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def kernel_available() -> bool:
    """The library built, with its AVX-512 code (without it the torch reference is as fast)."""
    return build.available() and torch.ops.kiln.int4_simd() == 1


def serves(device: str, x_dtype: torch.dtype, scale_dtype: torch.dtype, zeros_dtype,
           bias_dtype, simd: bool) -> bool:
    """Whether the native kernel computes int4_weight_linear for arguments of these kinds (a pure
    function of them and of `simd`, the kernel built with its AVX-512 code): on the CPU, x in a
    kernel dtype, scales in SCALE_DTYPES, zero points uint8 or none, a bias of x's dtype. Any even
    group size runs (groups of 32s take the in-register GEMV, others dequantized tiles)."""
    return (simd and device == "cpu" and x_dtype in build.DTYPES and scale_dtype in SCALE_DTYPES
            and zeros_dtype in (None, torch.uint8) and bias_dtype in (None, x_dtype))


def supported(x, w_packed, scales, zeros, group_size, bias=None) -> bool:
    on_cpu = all(t.device.type == "cpu" for t in (x, w_packed, scales))
    return (on_cpu and w_packed.dtype == torch.int32 and group_size % 2 == 0
            and serves("cpu", x.dtype, scales.dtype, None if zeros is None else zeros.dtype,
                       None if bias is None else bias.dtype, kernel_available()))


def gemv_row_limit(x_dtype: torch.dtype) -> int:
    """Rows of x (of a kernel dtype) up to which the kernel runs its GEMV, 8 rows a pass, rather
    than dequantizing the weight for one GEMM (groups of 32s; csrc/int4_linear.c decides)."""
    kernel_available()  # loads the library
    return torch.ops.kiln.int4_gemv_row_limit(x_dtype == torch.float32)


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """`scales` (float32 as loaded) in the narrowest of bfloat16, float16 that holds every one
    exactly (checkpoints save one of them: 16 bits a group, not 32); float32 where neither does."""
    for dtype in (torch.bfloat16, torch.float16):
        narrow = scales.to(dtype)
        if torch.equal(narrow.to(scales.dtype), scales):
            return narrow.contiguous()
    return scales


def bits_per_weight(w_packed: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None) -> float:
    """Bits of memory each weight of a layer in the canonical layout takes, scales and zero
    points included."""
    total = sum(t.numel() * t.element_size() for t in (w_packed, scales, zeros) if t is not None)
    return 8 * total / (w_packed.numel() * 8)
