"""RMSNorm scaled in float32 before rounding, with and without the residual add: Gemma's
(x * (1 + w)) and OLMo-2's (w * x) norms, where Llama's `rms_norm` rounds first, then scales.

`offset` is added to the weight (1.0 for Gemma, 0.0 for OLMo-2). These are ops of their own,
not rms_norm with another weight: the fusion passes (norm + quant, norm + linear) match the
rms_norm / fused_add_rms_norm nodes only, so they never fuse these as one of those. Only the
torch provider implements them; every mode runs the reference (inlined in compiled graphs).
"""
import torch

from kiln.ir.op import define


def _rms_norm_f32_scale_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            offset: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> dtype(x32 * rsqrt(mean(x32^2) + eps) * (offset +
    w32)) [..., hidden] in x's dtype (HF's GemmaRMSNorm with offset 1, Olmo2RMSNorm with 0)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (offset + weight.to(torch.float32))).to(x.dtype)


def _rms_norm_f32_scale_fake(x, weight, eps, offset):
    return torch.empty_like(x)


def _fused_add_rms_norm_f32_scale_ref(x: torch.Tensor, residual: torch.Tensor,
                                      weight: torch.Tensor, eps: float,
                                      offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_f32_scale(s, weight, eps, offset), s), s = x + residual in their dtype."""
    total = x + residual
    return _rms_norm_f32_scale_ref(total, weight, eps, offset), total


def _fused_add_rms_norm_f32_scale_fake(x, residual, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(x)


def _t(dtype, device, *shape):
    return torch.randn(*shape, dtype=dtype, device=device)


rms_norm_f32_scale = define(
    "rms_norm_f32_scale", "(Tensor x, Tensor weight, float eps, float offset) -> Tensor",
    _rms_norm_f32_scale_ref, _rms_norm_f32_scale_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 64), 1e-6, 1.0))

fused_add_rms_norm_f32_scale = define(
    "fused_add_rms_norm_f32_scale", "(Tensor x, Tensor residual, Tensor weight, float eps, "
    "float offset) -> (Tensor, Tensor)", _fused_add_rms_norm_f32_scale_ref,
    _fused_add_rms_norm_f32_scale_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 2, 64),
                           _t(dtype, device, 64), 1e-6, 1.0))
