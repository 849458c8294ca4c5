"""Platform classes: device name, default dtype, graph support, memory and distributed backend."""
import torch


class Platform:
    device_type: str = "cpu"
    default_dtype: torch.dtype = torch.float32
    supports_cudagraph: bool = False
    dist_backend: str = "gloo"
    # Inductor options for this device's compiles, under the user's inductor_compile_config.
    inductor_compile_defaults: dict = {}

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""
        raise NotImplementedError

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)


class CpuPlatform(Platform):
    # The compiled code's own input checks (sizes, strides, alignment, scalars): some 400 Python
    # calls per decode step, on inputs the compile stack itself builds. vLLM turns them off on
    # CPU too.
    inductor_compile_defaults = {"size_asserts": False, "alignment_asserts": False,
                                 "scalar_asserts": False}

    def mem_get_info(self) -> tuple[int, int]:
        """(available, total) bytes of host memory. Available is Linux's MemAvailable (free
        pages plus what the kernel can reclaim, such as the page cache) where /proc has it,
        else the free pages."""
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, total
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


class CudaPlatform(Platform):
    device_type = "cuda"
    default_dtype = torch.bfloat16
    supports_cudagraph = True
    dist_backend = "nccl"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
