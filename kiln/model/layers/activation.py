"""The MLPs' activations: SiLU- and GELU-and-multiply over a merged gate_up output (Llama,
Gemma), and plain GELU (StarCoder2, GPT-NeoX).

Each is an IR op (kiln/ir/layer_ops.py) carrying its meaning and its chosen implementation.
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


# HF's hidden_act names of GELU -> F.gelu's `approximate`: gelu_new and gelu_fast are HF's own
# writings of the tanh form (equal up to rounding)
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh",
                       "gelu_fast": "tanh"}


class Gelu(nn.Module):
    """GELU of a non-gated MLP (StarCoder2, GPT-NeoX), the IR op gelu."""

    def __init__(self, hidden_act: str):
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ir.gelu(x, self.approximate)  # [T, intermediate]
