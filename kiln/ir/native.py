"""The `native` provider: Kiln's CPU kernels (kiln/native/) as implementations of the IR ops,
each with what it supports, and the torch ops compiled graphs call them through.
"""
import torch

from kiln.custom_ops import register_op
from kiln.ir import layer_ops as ir
from kiln.ir.op import Implementation
from kiln.native import build, layer_ops, linear_op


def _cpu_kernel_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return (dtype in build.DTYPES
            and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors))


def _layer_kernels_built() -> bool:
    return layer_ops._lib() is not None


def rms_norm(x, weight, eps):
    return layer_ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return layer_ops.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox):
    return layer_ops.rotary(positions, q, k, cos_sin_cache, head_size)


def _rms_norm_supported(x, weight, eps) -> bool:
    return (_cpu_kernel_dtype(x, weight) and weight.dim() == 1
            and weight.numel() == x.shape[-1] and _layer_kernels_built())


def _fused_supported(x, residual, weight, eps) -> bool:
    return (_cpu_kernel_dtype(x, residual, weight) and residual.shape == x.shape
            and weight.dim() == 1 and weight.numel() == x.shape[-1] and _layer_kernels_built())


def _silu_supported(x) -> bool:
    return _cpu_kernel_dtype(x) and x.shape[-1] % 2 == 0 and _layer_kernels_built()


def _rotary_supported(positions, q, k, cos_sin_cache, head_size, is_neox) -> bool:
    # the kernel rotates neox halves only, reading the cache in float32
    return (bool(is_neox) and head_size % 2 == 0 and _cpu_kernel_dtype(q, k)
            and cos_sin_cache.dtype == torch.float32 and q.dim() == 2 and k.dim() == 2
            and _layer_kernels_built())


def _linear_supported(x, weight, bias=None) -> bool:
    return (_cpu_kernel_dtype(x, weight) and (bias is None or bias.dtype == x.dtype)
            and linear_op.available())


def _graph_op(name: str, schema: str, fn, fake):
    """The torch op a compiled graph calls `fn` through."""
    register_op(name, schema, fn, fake)
    return getattr(torch.ops.kiln, name).default


def register() -> None:
    ir.rms_norm.register(Implementation(
        "native", rms_norm, _rms_norm_supported,
        _graph_op("rms_norm_native", ir.rms_norm.schema, rms_norm, ir._rms_norm_fake)))
    ir.fused_add_rms_norm.register(Implementation(
        "native", fused_add_rms_norm, _fused_supported,
        _graph_op("fused_add_rms_norm_native", ir.fused_add_rms_norm.schema, fused_add_rms_norm,
                  ir._fused_add_rms_norm_fake)))
    ir.silu_and_mul.register(Implementation(
        "native", layer_ops.silu_and_mul, _silu_supported,
        _graph_op("silu_and_mul_native", ir.silu_and_mul.schema, layer_ops.silu_and_mul,
                  ir._silu_and_mul_fake)))
    ir.rotary_embedding.register(Implementation(
        "native", rotary_embedding, _rotary_supported,
        _graph_op("rotary_embedding_native", ir.rotary_embedding.schema, rotary_embedding,
                  ir._rotary_fake)))
    # csrc/linear_op.cpp: per call the GGUF blocks, GEMV or oneDNN's packed weight attached to
    # the weight at load (kiln/model/layers/cpu_gemm.py), else aten's linear.
    linear_native = _graph_op("linear_native", ir.linear.schema, ir._linear_ref, ir._linear_fake)
    ir.linear.register(Implementation("native", linear_native, _linear_supported,
                                      linear_native))
