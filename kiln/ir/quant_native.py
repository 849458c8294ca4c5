"""The `native` provider of the W8A8 int8 IR ops: kiln/native/int8_ops.py's AVX512-VNNI kernels
(the GEMM on AMX-INT8 tiles from 16 rows where the CPU has them, else oneDNN's int8 GEMM through
torch._int_mm from 64 rows; over a weight packed at load, the panel GEMM at every row count),
each with what it supports, as the `torch.ops.kiln.<op>_native` ops (csrc/ops_int8.cpp).
"""
from kiln.ir import int8_panels
from kiln.ir import quant as ir
from kiln.ir.native import register_all
from kiln.native import int8_ops


def _norm_supported(x, weight, eps) -> bool:
    # The kernel reads the weight in x's dtype (the reference multiplies in the promoted one).
    return (int8_ops.quant_supported(x) and weight.device.type == "cpu" and weight.dim() == 1
            and weight.numel() == x.shape[-1] and weight.dtype == x.dtype)


def _add_norm_supported(x, residual, weight, eps) -> bool:
    return (_norm_supported(x, weight, eps) and residual.shape == x.shape
            and residual.dtype == x.dtype)


def _silu_supported(x) -> bool:
    return int8_ops.quant_supported(x) and x.shape[-1] % 2 == 0


def _mm_silu_quant_supported(q, scale, w_panels, w_scale, bias, out_dtype) -> bool:
    return (int8_ops.panels_gemm_supported(q, scale, w_panels, w_scale, bias, out_dtype)
            and w_scale.numel() % 2 == 0)


def register() -> None:
    register_all({
        ir.dynamic_int8_quant: ("dynamic_int8_quant_native", int8_ops.quant_supported,
                                ir._quant_fake),
        ir.int8_scaled_mm: ("int8_scaled_mm_native", int8_ops.gemm_supported, ir._mm_fake),
        int8_panels.int8_scaled_mm_panels: ("int8_scaled_mm_panels_native",
                                            int8_ops.panels_gemm_supported,
                                            int8_panels._panels_mm_fake),
        int8_panels.int8_scaled_mm_panels_silu_quant: (
            "int8_scaled_mm_panels_silu_quant_native", _mm_silu_quant_supported,
            int8_panels._mm_silu_quant_fake),
        ir.rms_norm_dynamic_int8_quant: ("rms_norm_dynamic_int8_quant_native", _norm_supported,
                                         ir._rms_norm_quant_fake),
        ir.fused_add_rms_norm_dynamic_int8_quant: (
            "fused_add_rms_norm_dynamic_int8_quant_native", _add_norm_supported,
            ir._add_rms_norm_quant_fake),
        ir.silu_and_mul_dynamic_int8_quant: ("silu_and_mul_dynamic_int8_quant_native",
                                             _silu_supported, ir._silu_quant_fake),
    })
