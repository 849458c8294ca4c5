"""Random weights for benchmarks (load_format="dummy"): small normal init, seeded, no file needed.

Norm weights start at one so activations stay in a sane range through many layers. An int8
checkpoint's weights (W8A8) are random int8 with positive scales of the same spread.
"""
import torch
from torch import nn

from kiln.model.layers.layernorm import RMSNorm


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if id(param) in norm_params:
                param.fill_(1.0)
                continue
            if param.dtype == torch.int8:  # a normal draw of std 0.02 truncates to all zeros
                param.copy_(torch.randint(-127, 128, param.shape, generator=generator,
                                          dtype=torch.int8))
                continue
            if name.endswith("weight_scale"):  # uniform int8 has a spread of about 73
                param.fill_(std / 73)
                continue
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values)
