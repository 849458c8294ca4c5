"""Which device the model runs on; 'auto' asks the platform layer."""
from dataclasses import dataclass, field

import torch


@dataclass
class DeviceConfig:
    device: str = "auto"
    device_obj: torch.device = field(init=False)

    def __post_init__(self):
        from kiln.platforms import current_platform

        name = current_platform.device_type if self.device == "auto" else self.device
        if name not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        self.device = name
        self.device_obj = torch.device(name)
