"""SiLU-and-multiply: the gated activation of Llama-style MLPs over a merged gate_up output."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2  # x: [T, 2 * intermediate] = [gate | up]
        return F.silu(x[..., :d]) * x[..., d:]
