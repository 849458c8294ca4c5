"""Which device the model runs on; 'auto' asks the platform layer."""
from dataclasses import dataclass, field

import torch

from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a --device value ("auto": the platform's)."""
    from kiln.platforms import current_platform

    name = current_platform.device_type if device == "auto" else device
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda; got {device!r}")
    return name


@dataclass
class DeviceConfig(FreezableConfig):
    device: str = "auto"
    device_obj: torch.device = field(init=False)

    def __post_init__(self):
        from kiln.platforms import current_platform

        name = resolve_device(self.device)
        if name == "cuda" and not current_platform.is_cuda():
            raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device (a CPU "
                              "build of torch, or no GPU); use --device cpu or auto")
        self.device = name
        self.device_obj = torch.device(name)
