"""Python entry point of csrc/gemv.c: linear layers for decode steps of one or two rows on CPU.

There a linear is a pass over its weight; this kernel streams the dense weight at close to memory
bandwidth (measured, 2 cores: a 135M-parameter model's weights in 21 ms vs oneDNN's 30 ms, fp32).
"""
import ctypes

import torch

from kiln import envs
from kiln.native import build

# Up to this many rows the kernel wins; from 4 rows on oneDNN's packed GEMM does (measured).
MAX_ROWS = 2
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
SIGNATURES = (("kiln_gemv", (_P, _P, _P, _P, _I32, _I64, _I64, _I32, _I32)),)


def _lib() -> ctypes.CDLL | None:
    return build.load("gemv", SIGNATURES)


def available() -> bool:
    return _lib() is not None


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True for a CPU linear of at most MAX_ROWS rows with contiguous weights in a kernel dtype."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == weight.dtype
            and x.dtype in build.DTYPES and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and envs.native_cpu_ops() and _lib() is not None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] with at most MAX_ROWS rows @ weight [n, k]^T (+ bias) -> [..., n]."""
    n, k = weight.shape
    rows = x.reshape(-1, k).to(torch.float32).contiguous()  # [m, k]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    build.check(_lib().kiln_gemv(rows.data_ptr(), weight.data_ptr(),
                                 bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                 rows.shape[0], n, k, build.DTYPES[x.dtype],
                                 torch.get_num_threads()), "kiln_gemv")
    return out
