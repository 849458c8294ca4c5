"""The CPU a kernel micro-benchmark ran on, for its JSON report: the model name and the ISA flags
Kiln's native kernels choose their code paths by."""
import platform

import torch

from kiln.native import build

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
             "amx_tile")


def cpu() -> dict:
    """{"cpu": lscpu's model name, "isa_flags": those of ISA_FLAGS it has, "threads": torch's
    threads now, "torch": its version}."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), platform.processor())
    except OSError:
        model = platform.processor()
    flags = build.cpu_flags()
    return {"cpu": model, "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "threads": torch.get_num_threads(), "torch": torch.__version__}
