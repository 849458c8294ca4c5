"""SiLU-and-multiply: the gated activation of Llama-style MLPs over a merged gate_up output.

Eager CPU forwards take the fused C kernel (kiln/native/layer_ops.py).
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln.native import layer_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops.usable(x):
            return layer_ops.silu_and_mul(x)
        d = x.shape[-1] // 2  # x: [T, 2 * intermediate] = [gate | up]
        return F.silu(x[..., :d]) * x[..., d:]
