"""The W8A8 int8 CPU kernels (csrc/ops_int8.cpp over int8_ops.c: per-token dynamic quant, alone or
fused after RMSNorm / SiLU-and-mul, and the int8 GEMM) on AVX512-VNNI, the GEMM over packed
weights also on AMX-INT8 tiles (int8_amx_panels.c) where the CPU has them, as torch ops.

`*_supported(...)` says whether these tensors may take them: on the CPU, in a kernel dtype, the
library built for a CPU with AVX512-VNNI (`isa()`); otherwise the torch reference runs, whose
GEMM is torch._int_mm: oneDNN's, with AVX-VNNI dot products on CPUs that have those and no
AVX-512 (tests/quantization/test_int8_ops.py shows it with oneDNN capped there).
"""
import functools
import os

import torch

from kiln.logger import init_logger
from kiln.native import build

logger = init_logger(__name__)

# oneDNN's levels without an int8 dot product: its s8 GEMM then sums pairs of u8 x s8 products
# in saturating int16 (vpmaddubsw), so its int32 results are wrong, not rounded.
_NO_DOT_PRODUCT_ISAS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE", "AVX512_MIC",
                                  "AVX512_MIC_4OPS"})
_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def onednn_int8_exact(cpu_flags: set[str], max_isa: str | None) -> bool:
    """Whether oneDNN's int8 GEMM (torch._int_mm on the CPU) sums exactly: the CPU has VNNI or
    AMX-INT8 dot products (`cpu_flags` as /proc/cpuinfo names them) and `max_isa`
    (ONEDNN_MAX_CPU_ISA) does not hold oneDNN below them."""
    cap = max_isa.strip().upper() if max_isa else ""
    if cap in _NO_DOT_PRODUCT_ISAS:
        return False
    if cap.startswith("AVX2_VNNI"):
        # AVX-VNNI only: a CPU with AVX512-VNNI and no AVX-VNNI (Zen 4) runs plain AVX2 there
        return "avx_vnni" in cpu_flags
    return bool(_DOT_PRODUCT_FLAGS & cpu_flags)


@functools.cache
def cpu_int_mm_exact() -> bool:
    """onednn_int8_exact for this machine and process (said once where it is not)."""
    max_isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    exact = onednn_int8_exact(build.cpu_flags(), max_isa)
    if not exact:
        logger.warning("this CPU has no int8 dot products (VNNI, AMX-INT8)%s: int8 GEMMs run "
                       "as exact but slow float64 matmuls; bfloat16 serves faster here",
                       f" for oneDNN (ONEDNN_MAX_CPU_ISA={max_isa})" if max_isa else "")
    return exact


@functools.cache
def isa() -> str | None:
    """The dot-product instructions the kernels run ("avx512_vnni", or "amx_int8+avx512_vnni"
    where the packed GEMM's larger row counts run on AMX tiles), or None (no compiler, or a CPU
    without AVX512-VNNI)."""
    return (torch.ops.kiln.int8_isa() or None) if build.available() else None


def amx_min_rows() -> int:
    """From this many rows the GEMM over packed weights (and the panel GEMM) runs on AMX-INT8
    tiles; 0 where it never does (a CPU without AMX-INT8, or an OS that refuses this process the
    tiles' state, or no kernels at all)."""
    return torch.ops.kiln.int8_amx_min_rows() if isa() is not None else 0


def onednn_min_rows() -> int:
    """From this many rows the GEMM op over a weight as stored runs oneDNN's int8 GEMM and the
    VNNI kernel's epilogue, below it the VNNI kernel (csrc/ops_int8.cpp's ONEDNN_MIN_ROWS: 16
    where the library was built for AMX-INT8, else 64); 0 where there are no kernels."""
    return torch.ops.kiln.int8_onednn_min_rows() if isa() is not None else 0


def panels_min_rows() -> int:
    """From this many rows (k a multiple of 4) the GEMM op over a weight as stored packs it for
    the call and runs the panel GEMM (csrc/int8_vnni_gemm.c) instead of oneDNN's; 0 where
    there are no kernels."""
    return torch.ops.kiln.int8_panels_min_rows() if isa() is not None else 0


def mm_silu_quant_min_rows() -> int:
    """From this many rows the GEMM + SiLU-and-mul + quant op runs blocks of rows through all
    three in each thread (csrc/int8_gemm_silu_quant.c), below it the three kernels one after
    the other; 0 where there are no kernels."""
    return torch.ops.kiln.int8_mm_silu_quant_min_rows() if isa() is not None else 0


def _on_cpu_in(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return dtype in build.DTYPES and all(t.device.type == "cpu" for t in tensors)


def quant_supported(x: torch.Tensor) -> bool:
    return _on_cpu_in(x.dtype, x) and isa() is not None


def _gemm_supported(q, scale, w, w_dtype, w_dim, w_scale, bias, out_dtype) -> bool:
    """What both GEMM ops' kernels take: q int8 [M, K], float32 scales, the weight `w` in
    `w_dtype` with `w_dim` dimensions, a bias and output in a kernel dtype, all on the CPU."""
    return (_on_cpu_in(out_dtype, q, scale, w, w_scale) and q.dtype == torch.int8
            and w.dtype == w_dtype and scale.dtype == w_scale.dtype == torch.float32
            and q.dim() == 2 and w.dim() == w_dim
            and (bias is None or (bias.device.type == "cpu" and bias.dtype in build.DTYPES))
            and isa() is not None)


def gemm_supported(q, scale, w_q, w_scale, bias, out_dtype) -> bool:
    # Its larger row counts run oneDNN's GEMM (csrc/ops_int8.cpp), which must sum exactly.
    return (_gemm_supported(q, scale, w_q, torch.int8, 2, w_scale, bias, out_dtype)
            and cpu_int_mm_exact())


def panels_gemm_supported(q, scale, w_panels, w_scale, bias, out_dtype) -> bool:
    return _gemm_supported(q, scale, w_panels, torch.uint8, 4, w_scale, bias, out_dtype)


def panel_cpu() -> bool:
    """This CPU's int8 GEMM reads weights packed into panels at every row count: any CPU the
    kernels run on (VNNI register tiles, and AMX tiles from amx_min_rows())."""
    return isa() is not None


def packs_weights(in_features: int, device: torch.device | str) -> bool:
    """Whether an int8 weight of `in_features` columns on `device` is packed into panels at load
    (kiln/ir/int8_panels.py): on a panel CPU, K a multiple of 4."""
    return torch.device(device).type == "cpu" and in_features % 4 == 0 and panel_cpu()


def dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], scale float32 [..., 1])."""
    return torch.ops.kiln.dynamic_int8_quant_native(x)


def int8_scaled_mm(q: torch.Tensor, scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """q int8 [M, K], scale float32 [M, 1], w_q int8 [N, K], w_scale float32 [N] -> [M, N]."""
    return torch.ops.kiln.int8_scaled_mm_native(q, scale, w_q, w_scale, bias, out_dtype)


def int8_scaled_mm_panels(q, scale, w_panels, w_scale, bias, out_dtype) -> torch.Tensor:
    """int8_scaled_mm with the weight in panels (kiln/ir/int8_panels.py) -> [M, len(w_scale)]."""
    return torch.ops.kiln.int8_scaled_mm_panels_native(q, scale, w_panels, w_scale, bias,
                                                       out_dtype)


def int8_scaled_mm_panels_silu_quant(q, scale, w_panels, w_scale, bias, out_dtype):
    """dynamic_int8_quant(silu_and_mul(int8_scaled_mm_panels(...))) -> (q [M, N / 2], scale)."""
    return torch.ops.kiln.int8_scaled_mm_panels_silu_quant_native(q, scale, w_panels, w_scale,
                                                                  bias, out_dtype)


def rms_norm_dynamic_int8_quant(x, weight, eps):
    return torch.ops.kiln.rms_norm_dynamic_int8_quant_native(x, weight, eps)


def fused_add_rms_norm_dynamic_int8_quant(x, residual, weight, eps):
    return torch.ops.kiln.fused_add_rms_norm_dynamic_int8_quant_native(x, residual, weight, eps)


def silu_and_mul_dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.kiln.silu_and_mul_dynamic_int8_quant_native(x)
