"""The `native` provider: Kiln's CPU kernels (kiln/native/, one library of torch ops defined in C++)
as implementations of the IR ops, each with what it supports; eager forwards and compiled graphs
call the same `torch.ops.kiln.*_native` op (compiled graphs also its in-place form, if it has one).
"""
import torch

from kiln.custom_ops import LIB
from kiln.ir import gguf, gguf_layout, int4
from kiln.ir import layer_norm as ln
from kiln.ir import layer_ops as ir
from kiln.ir.op import Implementation, InplaceVariant, LazyOp
from kiln.native import build, gguf_matmul, int4_linear


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


def _layer_norm_supported(x, weight, bias, eps) -> bool:
    # weight and bias [hidden] of x's dtype (a float32 weight on bfloat16 x: the reference)
    hidden = x.shape[-1] if x.dim() else -1
    return (_cpu_kernel_dtype(x, weight, *([bias] if bias is not None else []))
            and weight.dim() == 1 and weight.numel() == hidden
            and (bias is None or (bias.dim() == 1 and bias.numel() == hidden))
            and build.available())


def _fused_add_layer_norm_supported(x, residual, weight, bias, eps) -> bool:
    return (_layer_norm_supported(x, weight, bias, eps) and _cpu_kernel_dtype(x, residual)
            and residual.shape == x.shape)


def _gelu_supported(x, approximate) -> bool:
    # rows of the last dim: a 0-dim x has none (the reference takes it)
    return (_cpu_kernel_dtype(x) and x.dim() >= 1 and approximate in ("none", "tanh")
            and build.available())


def _rotary_supported(positions, q, k, cos_sin_cache, head_size, is_neox) -> bool:
    # the kernel rotates neox halves or gpt-j pairs, reading the cache in float32
    return (head_size % 2 == 0 and _cpu_kernel_dtype(q, k)
            and cos_sin_cache.dtype == torch.float32 and q.dim() == 2 and k.dim() == 2
            and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size
            and build.available())


def _rows(t: torch.Tensor) -> bool:
    """[T, width] with contiguous columns (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


def _rotary_inplace_supported(positions, q, k, cos_sin_cache, head_size, is_neox) -> bool:
    # in place no conversion may stand in: the tables as the kernel reads them, q/k as rows
    return (_rotary_supported(positions, q, k, cos_sin_cache, head_size, is_neox)
            and _rows(q) and _rows(k) and positions.dtype == torch.int64
            and positions.dim() == 1 and positions.is_contiguous()
            and cos_sin_cache.is_contiguous())


def _fused_inplace_supported(x, residual, weight, eps) -> bool:
    # the kernel writes the sum in rows of `hidden`, the normed value over x's rows
    return (_fused_supported(x, residual, weight, eps) and _rows(x) and _rows(residual)
            and (residual.shape[0] <= 1 or residual.stride(0) == residual.shape[1]))


def _linear_supported(x, weight, bias=None, packed=None, plan=None) -> bool:
    return (_cpu_kernel_dtype(x, weight) and (bias is None or bias.dtype == x.dtype)
            and build.available())


def _gguf_linear_supported(x, blocks, qtype, out_features, bias=None, weight=None, packed=None,
                           plan=None) -> bool:
    """The blocks kernel reads them for x (its vector code built: AVX-512), and a dense copy,
    where there is one, is of x's dtype and the weight's shape."""
    in_features = x.shape[-1]
    return (_cpu_kernel_dtype(x) and blocks.device.type == "cpu"
            and gguf_layout.fits(blocks, qtype, out_features, in_features)
            and (bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (out_features,)))
            and (weight is None or (_cpu_kernel_dtype(x, weight)
                                    and tuple(weight.shape) == (out_features, in_features)))
            and gguf_matmul.kernel_available())


def _gguf_embedding_supported(ids, blocks, qtype, num_embeddings, embedding_dim, dtype) -> bool:
    return (dtype in build.DTYPES and ids.device.type == "cpu"
            and ids.dtype in (torch.int64, torch.int32)
            and blocks.device.type == "cpu"
            and gguf_layout.fits(blocks, qtype, num_embeddings, embedding_dim)
            and gguf_matmul.kernel_available())


# IR op -> (its native op, the IR op's fake: the native op's too)
NATIVE_OPS = {
    ir.rms_norm: ("rms_norm_native", _rms_norm_supported, ir._rms_norm_fake),
    ir.fused_add_rms_norm: ("fused_add_rms_norm_native", _fused_supported,
                            ir._fused_add_rms_norm_fake),
    ir.silu_and_mul: ("silu_and_mul_native", _silu_supported, ir._silu_and_mul_fake),
    ir.rotary_embedding: ("rotary_embedding_native", _rotary_supported, ir._rotary_fake),
    # csrc/layer_norm.c: the LayerNorm families' norm (bias optional) and non-gated GELU
    ln.layer_norm: ("layer_norm_native", _layer_norm_supported, ln._layer_norm_fake),
    ln.fused_add_layer_norm: ("fused_add_layer_norm_native", _fused_add_layer_norm_supported,
                              ln._fused_add_layer_norm_fake),
    ir.gelu: ("gelu_native", _gelu_supported, ir._gelu_fake),
    # csrc/linear_op.cpp: per call GEMV or oneDNN's packed weight the layer hands over
    # (kiln/model/layers/cpu_gemm.py), else aten's linear; gguf_linear: the blocks up to the
    # plan's row limit, the dense copy's kernels above it.
    ir.linear: ("linear_native", _linear_supported, ir._linear_fake),
    gguf.gguf_linear: ("gguf_linear_native", _gguf_linear_supported, gguf._gguf_linear_fake),
    # csrc/gguf_rows.c: each id's row decoded from its group of 16
    gguf.gguf_embedding: ("gguf_embedding_native", _gguf_embedding_supported,
                          gguf._gguf_embedding_fake),
    # csrc/ops_int4.cpp: W4A16 on the canonical layout as loaded (in-register GEMV for decode
    # rows, dequantized tiles and oneDNN's GEMM for prefill)
    int4.int4_weight_linear: ("int4_weight_linear_native", int4_linear.supported,
                              int4._int4_linear_fake),
}


# IR op -> (its native op's in-place form, the arguments it writes the outputs into, what it
# supports); csrc/ops_layer.cpp. Only compiled graphs call them, where the pass proved the
# arguments dead after the call.
INPLACE_OPS = {
    ir.rotary_embedding: ("rotary_embedding_native_", (1, 2), _rotary_inplace_supported),
    ir.fused_add_rms_norm: ("fused_add_rms_norm_native_", (0, 1), _fused_inplace_supported),
}


def _writes_nothing(*args) -> None:
    return None


def register_fakes(ops: dict, inplace: dict | None = None) -> None:
    """Once the library is loaded: each native op's fake, for tracing (an in-place form's
    returns nothing)."""
    def register():
        for name, _, fake in ops.values():
            torch.library.register_fake(f"kiln::{name}", fake, lib=LIB)
        for name, _, _ in (inplace or {}).values():
            torch.library.register_fake(f"kiln::{name}", _writes_nothing, lib=LIB)
    build.on_load(register)


def register_all(ops: dict, inplace: dict | None = None) -> None:
    inplace = inplace or {}
    for op, (name, supported, _) in ops.items():
        variant = None
        if op in inplace:
            inplace_name, mutates, inplace_supported = inplace[op]
            variant = InplaceVariant(LazyOp(inplace_name), mutates, inplace_supported)
        op.register(Implementation("native", LazyOp(name), supported, LazyOp(name), variant))
    register_fakes(ops, inplace)


def register() -> None:
    register_all(NATIVE_OPS, INPLACE_OPS)
