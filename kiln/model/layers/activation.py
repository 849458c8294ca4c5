"""SiLU-and-multiply: the gated activation of Llama-style MLPs over a merged gate_up output.

The IR op `silu_and_mul` (kiln/ir/) carries its meaning and its chosen implementation.
"""
import torch
from torch import nn

from kiln import ir


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ir.silu_and_mul(x)  # [T, 2 * intermediate] = [gate | up] -> [T, intermediate]


class GeluTanhAndMul(nn.Module):
    """GeGLU (Gemma): gelu_pytorch_tanh(gate) * up, the IR op gelu_tanh_and_mul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ir.gelu_tanh_and_mul(x)  # [T, 2 * intermediate] = [gate | up] -> [T, intermediate]
