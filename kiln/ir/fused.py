"""The fused ops Kiln's passes put in compiled graphs in place of an IR op and the linear it feeds
(kiln/compilation/passes/fuse_*.py), one per linear IR op (`linear`, `gguf_linear`); their CPU
kernels are in kiln/native/csrc/fused_linear_op.cpp.

Defined here with the composition of the IR references as their meaning (what runs off the CPU).
"""
import torch

from kiln.custom_ops import register_op
from kiln.ir import gguf
from kiln.ir import layer_ops as ir


def _add_rms_norm_linear(x, residual, norm_weight, eps: float, weight, bias=None, packed=None,
                         plan=None):
    normed, total = ir._fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return ir._linear_ref(normed, weight, bias), total


def _add_rms_norm_linear_fake(x, residual, norm_weight, eps, weight, bias=None, packed=None,
                              plan=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(x)


def _silu_mul_linear(x, weight, bias=None, packed=None, plan=None):
    return ir._linear_ref(ir._silu_and_mul_ref(x), weight, bias)


def _silu_mul_linear_fake(x, weight, bias=None, packed=None, plan=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _add_rms_norm_gguf_linear(x, residual, norm_weight, eps: float, blocks, qtype: int,
                              out_features: int, bias=None, weight=None, packed=None, plan=None):
    normed, total = ir._fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return gguf._gguf_linear_ref(normed, blocks, qtype, out_features, bias), total


def _add_rms_norm_gguf_linear_fake(x, residual, norm_weight, eps, blocks, qtype, out_features,
                                   bias=None, weight=None, packed=None, plan=None):
    return x.new_empty((*x.shape[:-1], out_features)), torch.empty_like(x)


def _silu_mul_gguf_linear(x, blocks, qtype: int, out_features: int, bias=None, weight=None,
                          packed=None, plan=None):
    return gguf._gguf_linear_ref(ir._silu_and_mul_ref(x), blocks, qtype, out_features, bias)


def _silu_mul_gguf_linear_fake(x, blocks, qtype, out_features, bias=None, weight=None,
                               packed=None, plan=None):
    return x.new_empty((*x.shape[:-1], out_features))


# the linear's own arguments after its weight (the IR op linear's)
_LINEAR_TAIL = "Tensor weight, Tensor? bias=None, Tensor? packed=None, Tensor? plan=None"
_NORM = "Tensor a, Tensor b, Tensor norm_weight, float eps"
# (linear(rms_norm(x + residual)), x + residual), for each linear op
register_op("add_rms_norm_linear", f"({_NORM}, {_LINEAR_TAIL}) -> (Tensor, Tensor)",
            _add_rms_norm_linear, _add_rms_norm_linear_fake)
register_op("add_rms_norm_gguf_linear", f"({_NORM}, {gguf.TAIL}) -> (Tensor, Tensor)",
            _add_rms_norm_gguf_linear, _add_rms_norm_gguf_linear_fake)
# linear(silu_and_mul(x)), for each linear op
register_op("silu_mul_linear", f"(Tensor x, {_LINEAR_TAIL}) -> Tensor", _silu_mul_linear,
            _silu_mul_linear_fake)
register_op("silu_mul_gguf_linear", f"(Tensor x, {gguf.TAIL}) -> Tensor", _silu_mul_gguf_linear,
            _silu_mul_gguf_linear_fake)
