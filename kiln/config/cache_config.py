"""KV cache configuration: block size, memory budget, prefix caching."""
import math
from dataclasses import dataclass

from kiln.attention.kv_cache_dtype import check_cache_dtype, torch_cache_dtype
from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError


@dataclass
class CacheConfig(FreezableConfig):
    block_size: int = 16
    # GiB for the KV cache. CPU: host memory (None: KILN_CPU_KVCACHE_SPACE, else 4 GiB).
    # CUDA: device memory, in place of gpu_memory_utilization's share (None: that share).
    kv_cache_memory: float | None = None
    # CUDA: fraction of total device memory in use once the KV cache is allocated (weights,
    # activations, KV; other engines and processes on the device count too).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Overrides the memory-derived block count (tests use it to force preemption). The count
    # the engine settles on is its state (EngineCore.num_blocks, Worker.num_blocks), no setting.
    num_gpu_blocks_override: int | None = None
    # The KV cache's elements (vLLM's --kv-cache-dtype): "auto" the model's dtype, "fp8" /
    # "fp8_e4m3" float8_e4m3fn, "fp8_e5m2" float8_e5m2 (half a bfloat16 cache's bytes).
    cache_dtype: str = "auto"

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and not 0 < self.kv_cache_memory < math.inf:
            raise ConfigError("kv_cache_memory (--kv-cache-memory) must be a finite number of "
                              f"GiB > 0, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_cache_dtype(self.cache_dtype)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")

    def torch_cache_dtype(self, model_dtype):
        """The KV cache tensors' dtype for a model of model_dtype."""
        return torch_cache_dtype(self.cache_dtype, model_dtype)

    def larger_cache_flags(self) -> str:
        """The flags that make the KV cache hold more tokens, for error messages. With
        --num-gpu-blocks-override set, only it does: memory flags do not change its count."""
        if self.num_gpu_blocks_override is not None:
            return f"--num-gpu-blocks-override (set to {self.num_gpu_blocks_override})"
        return "--kv-cache-memory (CPU) or --gpu-memory-utilization"
