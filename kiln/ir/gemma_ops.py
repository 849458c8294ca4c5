"""Gemma's layer ops: the RMSNorm that scales by (1 + weight) in float32 before rounding, with and
without the residual add, and GeGLU (tanh-approximated GELU gate times up).

Their references are HF's Gemma code, rounding where it does. They are ops of their own, not
rms_norm / silu_and_mul with other weights: the fusion passes (norm + quant, norm + linear,
act + quant, act + linear) match those ops' nodes only, so they never fuse these as one of them.
Only the torch provider implements them; modes 0 and 3 run the reference (inlined in graphs).
"""
import torch
import torch.nn.functional as F

from kiln.ir.op import define


def _gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> dtype(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32))
    [..., hidden] in x's dtype (HF's GemmaRMSNorm: scaled in float32, then rounded)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.to(torch.float32))).to(x.dtype)


def _gemma_rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def _gemma_fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rms_norm(s, weight, eps), s), s = x + residual rounded to their dtype."""
    total = x + residual
    return _gemma_rms_norm_ref(total, weight, eps), total


def _gemma_fused_add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> dtype(gelu_tanh(gate)) * up [..., d] (HF's
    gelu_pytorch_tanh(gate_proj(x)) * up_proj(x))."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _gelu_tanh_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _t(dtype, device, *shape):
    return torch.randn(*shape, dtype=dtype, device=device)


gemma_rms_norm = define(
    "gemma_rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", _gemma_rms_norm_ref,
    _gemma_rms_norm_fake, lambda dtype, device: (_t(dtype, device, 2, 64),
                                                 _t(dtype, device, 64), 1e-6))

gemma_fused_add_rms_norm = define(
    "gemma_fused_add_rms_norm", "(Tensor x, Tensor residual, Tensor weight, float eps) -> "
    "(Tensor, Tensor)", _gemma_fused_add_rms_norm_ref, _gemma_fused_add_rms_norm_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 2, 64),
                           _t(dtype, device, 64), 1e-6))

gelu_tanh_and_mul = define(
    "gelu_tanh_and_mul", "(Tensor x) -> Tensor", _gelu_tanh_and_mul_ref, _gelu_tanh_and_mul_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64),))
