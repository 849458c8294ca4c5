"""The W8A8 int8 ops as torch ops (`torch.ops.kiln.*`), so compiled graphs hold them as nodes:
each runs the native CPU kernel where `supported`, else the plain-torch reference.
"""
import torch

from kiln.custom_ops import register_op
from kiln.model.layers.quantization import int8_reference as ref
from kiln.native import int8_ops as native


def _pick(supported: bool, native_fn, ref_fn):
    return native_fn if supported else ref_fn


def _dynamic_int8_quant(x):
    return _pick(native.quant_supported(x), native.dynamic_int8_quant, ref.dynamic_int8_quant)(x)


def _int8_scaled_mm(q, scale, w_q, w_scale, bias, out_dtype):
    fn = _pick(native.gemm_supported(q, scale, w_q, w_scale, bias, out_dtype),
               native.int8_scaled_mm, ref.int8_scaled_mm)
    return fn(q, scale, w_q, w_scale, bias, out_dtype)


def _quant_fake(x):
    return (torch.empty(x.shape, dtype=torch.int8, device=x.device),
            torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device))


def _mm_fake(q, scale, w_q, w_scale, bias, out_dtype):
    return torch.empty(*q.shape[:-1], w_q.shape[0], dtype=out_dtype, device=q.device)


register_op("dynamic_int8_quant", "(Tensor x) -> (Tensor, Tensor)", _dynamic_int8_quant,
            _quant_fake)
register_op("int8_scaled_mm", "(Tensor q, Tensor scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
            "ScalarType out_dtype) -> Tensor", _int8_scaled_mm, _mm_fake)


def dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.kiln.dynamic_int8_quant(x)


def int8_scaled_mm(q, scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    return torch.ops.kiln.int8_scaled_mm(q, scale, w_q, w_scale, bias, out_dtype)
