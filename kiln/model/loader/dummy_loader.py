"""Random weights for benchmarks (load_format="dummy"): small normal init, seeded, no file needed.

Norm weights start at one so activations stay in a sane range through many layers.
"""
import torch
from torch import nn

from kiln.model.layers.layernorm import RMSNorm


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for _, param in model.named_parameters():  # tied weights appear once
            if id(param) in norm_params:
                param.fill_(1.0)
                continue
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values)
