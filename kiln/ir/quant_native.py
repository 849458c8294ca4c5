"""The `native` provider of the W8A8 int8 IR ops: kiln/native/int8_ops.py's AVX512-VNNI kernels
(oneDNN's int8 GEMM through torch._int_mm from 16 rows, AMX-INT8 there where the CPU has it),
each with what it supports, and the torch ops compiled graphs call them through.
"""
import torch

from kiln.custom_ops import register_op
from kiln.ir import quant as ir
from kiln.ir.op import Implementation
from kiln.native import int8_ops


def _norm_supported(x, weight, eps) -> bool:
    return (int8_ops.quant_supported(x) and weight.device.type == "cpu" and weight.dim() == 1
            and weight.numel() == x.shape[-1])


def _add_norm_supported(x, residual, weight, eps) -> bool:
    return (_norm_supported(x, weight, eps) and residual.shape == x.shape
            and residual.dtype == x.dtype)


def _silu_supported(x) -> bool:
    return int8_ops.quant_supported(x) and x.shape[-1] % 2 == 0


def _register(op, fn, supported) -> None:
    """`fn` as op's native implementation, and as `kiln::<op>_native` for compiled graphs."""
    name = f"{op.name}_native"
    register_op(name, op.schema, fn, _FAKES[op.name])
    op.register(Implementation("native", fn, supported, getattr(torch.ops.kiln, name).default))


_FAKES = {
    "dynamic_int8_quant": ir._quant_fake,
    "int8_scaled_mm": ir._mm_fake,
    "rms_norm_dynamic_int8_quant": ir._rms_norm_quant_fake,
    "fused_add_rms_norm_dynamic_int8_quant": ir._add_rms_norm_quant_fake,
    "silu_and_mul_dynamic_int8_quant": ir._silu_quant_fake,
}


def register() -> None:
    _register(ir.dynamic_int8_quant, int8_ops.dynamic_int8_quant, int8_ops.quant_supported)
    _register(ir.int8_scaled_mm, int8_ops.int8_scaled_mm, int8_ops.gemm_supported)
    _register(ir.rms_norm_dynamic_int8_quant, int8_ops.rms_norm_dynamic_int8_quant,
              _norm_supported)
    _register(ir.fused_add_rms_norm_dynamic_int8_quant,
              int8_ops.fused_add_rms_norm_dynamic_int8_quant, _add_norm_supported)
    _register(ir.silu_and_mul_dynamic_int8_quant, int8_ops.silu_and_mul_dynamic_int8_quant,
              _silu_supported)
