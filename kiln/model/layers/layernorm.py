"""RMSNorm (and LayerNorm), optionally fused with the residual add that precedes it in a decoder
layer.

Normalises in float32 and scales in the input dtype, as Hugging Face's Llama does: the IR ops
`rms_norm` and `fused_add_rms_norm` (kiln/ir/layer_ops.py) define it.
"""
import torch
from torch import nn

from kiln import ir
from kiln.model.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return ir.rms_norm(x, self.weight, self.eps)
        return ir.fused_add_rms_norm(x, residual, self.weight, self.eps)


class F32ScaleRMSNorm(RMSNorm):
    """OLMo-2's RMSNorm: scales by the weight in float32, then rounds to the input dtype (the IR
    ops rms_norm_f32_scale / fused_add_rms_norm_f32_scale, kiln/ir/f32_scale_norm.py). Their
    own ops, so no pass fuses it as a plain RMSNorm (which rounds, then scales)."""
    offset = 0.0  # added to the weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ir.rms_norm_f32_scale(x, self.weight, self.eps, self.offset)
        return ir.fused_add_rms_norm_f32_scale(x, residual, self.weight, self.eps, self.offset)


class GemmaRMSNorm(F32ScaleRMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight) in float32, then rounds."""
    offset = 1.0


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (StarCoder2, GPT-NeoX, Phi: HF's nn.LayerNorm; Cohere's
    has no bias), the IR ops layer_norm and fused_add_layer_norm; called as RMSNorm is, so
    Llama's decoder layer takes it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return ir.layer_norm(x, self.weight, self.bias, self.eps)
        return ir.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
