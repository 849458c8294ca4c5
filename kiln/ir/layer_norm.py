"""LayerNorm, bias optional (StarCoder2, GPT-NeoX, Phi, Cohere): the IR ops `layer_norm` and
`fused_add_layer_norm` (the residual add before it), whose reference is torch's `F.layer_norm`.

The native provider (kiln/ir/native.py) runs them eagerly; compiled graphs inline the reference,
which Inductor fuses. No fusion pass matches them (they match rms_norm / fused_add_rms_norm), so
int8 activations are quantized by their own op.
"""
import torch
import torch.nn.functional as F

from kiln.ir.op import define


def _layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """x [..., hidden], weight and bias [hidden] -> (x - mean) / sqrt(var + eps) * weight +
    bias over the last dim, [..., hidden] in x's dtype (torch's F.layer_norm: float32
    statistics for bfloat16 / float16 inputs on every device)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _layer_norm_fake(x, weight, bias, eps):
    return torch.empty_like(x)


def _fused_add_layer_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., hidden] of one dtype -> (layer_norm(s, weight, bias, eps), s),
    s = x + residual rounded to that dtype. Functional: both are new tensors."""
    total = x + residual
    return _layer_norm_ref(total, weight, bias, eps), total


def _fused_add_layer_norm_fake(x, residual, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _t(dtype, device, *shape):
    return torch.randn(*shape, dtype=dtype, device=device)


layer_norm = define(
    "layer_norm", "(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    _layer_norm_ref, _layer_norm_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 64),
                           _t(dtype, device, 64), 1e-5))

fused_add_layer_norm = define(
    "fused_add_layer_norm", "(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) "
    "-> (Tensor, Tensor)", _fused_add_layer_norm_ref, _fused_add_layer_norm_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 2, 64),
                           _t(dtype, device, 64), _t(dtype, device, 64), 1e-5))
