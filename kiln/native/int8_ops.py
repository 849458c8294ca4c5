"""Python entry points of csrc/int8_ops.c: W8A8 int8 CPU kernels (per-token dynamic quant, alone
or fused after RMSNorm / SiLU-and-mul, and the int8 GEMM) on AVX512-VNNI.

`supported(...)` says whether these tensors may take them: on the CPU, in a kernel dtype, the
library built for a CPU with AVX512-VNNI (`isa()`); otherwise the torch reference runs.
"""
import ctypes
import functools

import torch

from kiln.native import build

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = (
    ("kiln_int8_isa", ()),
    ("kiln_dynamic_int8_quant", (_P, _I64, _P, _P, _I64, _I64, _I32, _I32)),
    ("kiln_rms_norm_int8_quant", (_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I32, _F, _I32,
                                  _I32)),
    ("kiln_silu_and_mul_int8_quant", (_P, _I64, _P, _P, _I64, _I32, _I32, _I32)),
    ("kiln_int8_gemm", (_P, _I64, _P, _P, _I64, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I32,
                        _I32)),
    ("kiln_int8_scale", (_P, _I64, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I32, _I32)),
)
_NO_BIAS = -1
# From this many rows oneDNN's int8 GEMM (torch._int_mm, its int32 sums exact) followed by this
# library's epilogue beats the VNNI kernel here, which reads the weight as stored and wins at
# decode sizes (measured, 2 cores of an EPYC with AVX512-VNNI: [256, 576] x [960, 576] 0.14 ms vs
# 0.26 ms; [8, 1536] x [576, 1536] 0.030 ms vs 0.017 ms).
ONEDNN_MIN_ROWS = 16


def _lib() -> ctypes.CDLL | None:
    return build.load("int8_ops", SIGNATURES)


@functools.cache
def isa() -> str | None:
    """The dot-product instructions the kernels were built with ("avx512_vnni"), or None (no
    compiler, or a CPU without them). AMX-INT8 CPUs run the same AVX512-VNNI code."""
    lib = _lib()
    return "avx512_vnni" if lib is not None and lib.kiln_int8_isa() == 1 else None


def _on_cpu_in(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return dtype in build.DTYPES and all(t.device.type == "cpu" for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def quant_supported(x: torch.Tensor) -> bool:
    return _on_cpu_in(x.dtype, x) and isa() is not None


def gemm_supported(q, scale, w_q, w_scale, bias, out_dtype) -> bool:
    return (_on_cpu_in(out_dtype, q, scale, w_q, w_scale) and q.dtype == w_q.dtype == torch.int8
            and scale.dtype == w_scale.dtype == torch.float32 and q.dim() == 2 and w_q.dim() == 2
            and (bias is None or (bias.device.type == "cpu" and bias.dtype in build.DTYPES))
            and isa() is not None)


def _run(fn: str, *args) -> None:
    rc = getattr(_lib(), fn)(*args)
    if rc == 4:
        raise RuntimeError(f"{fn}: the int8 kernels were built for a CPU without AVX512-VNNI")
    build.check(rc, fn)


def dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], scale float32 [..., 1])."""
    rows = _rows(x)
    n, k = rows.shape
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    _run("kiln_dynamic_int8_quant", rows.data_ptr(), rows.stride(0), q.data_ptr(),
         scale.data_ptr(), n, k, build.DTYPES[x.dtype], torch.get_num_threads())
    return q, scale


def int8_scaled_mm(q: torch.Tensor, scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """q int8 [M, K], scale float32 [M, 1], w_q int8 [N, K], w_scale float32 [N] -> [M, N]."""
    m, k = q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k or scale.numel() != m or w_scale.numel() != n or (
            bias is not None and bias.numel() != n):
        raise ValueError(f"int8_scaled_mm: q {tuple(q.shape)}, scale {tuple(scale.shape)}, w_q "
                         f"{tuple(w_q.shape)}, w_scale {tuple(w_scale.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit together")
    q = q if q.stride(-1) == 1 else q.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    scale, w_scale = scale.contiguous(), w_scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty(m, n, dtype=out_dtype)
    bias_args = (bias.data_ptr() if bias is not None else None,
                 build.DTYPES[bias.dtype] if bias is not None else _NO_BIAS)
    if m >= ONEDNN_MIN_ROWS and k > 1:  # (torch 2.13's CPU _int_mm is wrong for k == 1)
        acc = torch._int_mm(q, w_q.t())  # [M, N] int32
        _run("kiln_int8_scale", acc.data_ptr(), acc.stride(0), scale.data_ptr(),
             w_scale.data_ptr(), *bias_args, out.data_ptr(), n, m, n, build.DTYPES[out_dtype],
             torch.get_num_threads())
        return out
    _run("kiln_int8_gemm", q.data_ptr(), q.stride(0), scale.data_ptr(), w_q.data_ptr(),
         w_q.stride(0), w_scale.data_ptr(), *bias_args, out.data_ptr(), n, m, n, k,
         build.DTYPES[out_dtype], torch.get_num_threads())
    return out


def _norm_quant(x, residual, weight, eps):
    rows = _rows(x)
    n, hidden = rows.shape
    if weight.numel() != hidden:
        raise ValueError(f"rms_norm quant: weight has {weight.numel()} values for hidden size "
                         f"{hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm quant: residual shape {tuple(residual.shape)} != x shape "
                         f"{tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    res_rows = _rows(residual) if residual is not None else None
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    _run("kiln_rms_norm_int8_quant", rows.data_ptr(), rows.stride(0),
         res_rows.data_ptr() if res_rows is not None else None,
         res_rows.stride(0) if res_rows is not None else 0,
         res_out.data_ptr() if res_out is not None else None,
         weight.to(x.dtype).contiguous().data_ptr(), q.data_ptr(), scale.data_ptr(), n, hidden,
         eps, build.DTYPES[x.dtype], torch.get_num_threads())
    return q, scale, res_out


def rms_norm_dynamic_int8_quant(x, weight, eps):
    q, scale, _ = _norm_quant(x, None, weight, eps)
    return q, scale


def fused_add_rms_norm_dynamic_int8_quant(x, residual, weight, eps):
    return _norm_quant(x, residual, weight, eps)


def silu_and_mul_dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    n, width = rows.shape
    if width % 2:
        raise ValueError(f"silu_and_mul quant: the last dimension ({width}) must be even "
                         "[gate | up]")
    d = width // 2
    q = torch.empty(*x.shape[:-1], d, dtype=torch.int8)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    _run("kiln_silu_and_mul_int8_quant", rows.data_ptr(), rows.stride(0), q.data_ptr(),
         scale.data_ptr(), n, d, build.DTYPES[x.dtype], torch.get_num_threads())
    return q, scale
