"""LayerNorm with a bias (StarCoder2, GPT-NeoX): the IR op `layer_norm`, whose reference is
torch's `F.layer_norm`, what HF's `nn.LayerNorm` runs.

Only the torch provider implements it: every mode runs the reference (inlined in compiled
graphs, where Inductor fuses it with the residual add before it). No fusion pass matches it
(they match rms_norm / fused_add_rms_norm), so int8 activations are quantized by their own op.
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


def _t(dtype, device, *shape):
    return torch.randn(*shape, dtype=dtype, device=device)


layer_norm = define(
    "layer_norm", "(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    _layer_norm_ref, _layer_norm_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 64),
                           _t(dtype, device, 64), 1e-5))
