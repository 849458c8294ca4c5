"""What differs between CPU and CUDA, behind `current_platform`.

No other module calls `torch.cuda.is_available()`; they ask the platform instead.
"""
from kiln.platforms.interface import CpuPlatform, CudaPlatform, Platform


def _detect() -> Platform:
    import torch

    return CudaPlatform() if torch.cuda.is_available() else CpuPlatform()


current_platform: Platform = _detect()


def for_device(device: str) -> Platform:
    """The platform of a device name ("cpu" | "cuda"), e.g. a CPU engine on a GPU machine."""
    return CudaPlatform() if device == "cuda" else CpuPlatform()


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "current_platform", "for_device"]
