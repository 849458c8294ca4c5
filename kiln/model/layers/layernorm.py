"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Normalises in float32 and scales in the input dtype, as Hugging Face's Llama does; eager CPU
forwards take the fused C kernel (kiln/native/layer_ops.py), which rounds the same way.
"""
import torch
from torch import nn

from kiln.model.layers.linear import default_weight_loader
from kiln.native import layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with residual: (norm(x + residual), x + residual)."""
        operands = (x, self.weight) if residual is None else (x, self.weight, residual)
        if layer_ops.usable(*operands):
            return layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
