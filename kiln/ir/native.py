"""The `native` provider: Kiln's CPU kernels (kiln/native/, one library of torch ops defined in C++)
as implementations of the IR ops, each with what it supports; eager forwards and compiled graphs
call the same `torch.ops.kiln.*_native` op.
"""
import torch

from kiln.custom_ops import LIB
from kiln.ir import layer_ops as ir
from kiln.ir.op import Implementation, LazyOp
from kiln.native import build


def _cpu_kernel_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return (dtype in build.DTYPES
            and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors))


def _rms_norm_supported(x, weight, eps) -> bool:
    return (_cpu_kernel_dtype(x, weight) and weight.dim() == 1
            and weight.numel() == x.shape[-1] and build.available())


def _fused_supported(x, residual, weight, eps) -> bool:
    return (_cpu_kernel_dtype(x, residual, weight) and residual.shape == x.shape
            and weight.dim() == 1 and weight.numel() == x.shape[-1] and build.available())


def _silu_supported(x) -> bool:
    return _cpu_kernel_dtype(x) and x.shape[-1] % 2 == 0 and build.available()


def _rotary_supported(positions, q, k, cos_sin_cache, head_size, is_neox) -> bool:
    # the kernel rotates neox halves or gpt-j pairs, reading the cache in float32
    return (head_size % 2 == 0 and _cpu_kernel_dtype(q, k)
            and cos_sin_cache.dtype == torch.float32 and q.dim() == 2 and k.dim() == 2
            and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size
            and build.available())


def _linear_supported(x, weight, bias=None, packed=None, blocks=None, plan=None) -> bool:
    return (_cpu_kernel_dtype(x, weight) and (bias is None or bias.dtype == x.dtype)
            and build.available())


# IR op -> (its native op, the IR op's fake: the native op's too)
NATIVE_OPS = {
    ir.rms_norm: ("rms_norm_native", _rms_norm_supported, ir._rms_norm_fake),
    ir.fused_add_rms_norm: ("fused_add_rms_norm_native", _fused_supported,
                            ir._fused_add_rms_norm_fake),
    ir.silu_and_mul: ("silu_and_mul_native", _silu_supported, ir._silu_and_mul_fake),
    ir.rotary_embedding: ("rotary_embedding_native", _rotary_supported, ir._rotary_fake),
    # csrc/linear_op.cpp: per call the GGUF blocks, GEMV or oneDNN's packed weight the layer
    # hands over (kiln/model/layers/cpu_gemm.py), else aten's linear.
    ir.linear: ("linear_native", _linear_supported, ir._linear_fake),
}


def register_fakes(ops: dict) -> None:
    """Once the library is loaded: each native op's fake, for tracing."""
    def register():
        for name, _, fake in ops.values():
            torch.library.register_fake(f"kiln::{name}", fake, lib=LIB)
    build.on_load(register)


def register_all(ops: dict) -> None:
    for op, (name, supported, _) in ops.items():
        op.register(Implementation("native", LazyOp(name), supported, LazyOp(name)))
    register_fakes(ops)


def register() -> None:
    register_all(NATIVE_OPS)
