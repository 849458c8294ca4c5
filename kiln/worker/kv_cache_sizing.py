"""How many KV blocks fit: pure arithmetic over the cache layout and a memory budget.

The worker supplies the budget (CPU: configured GiB; CUDA: measured after a profiling run).
"""
import math
from collections.abc import Iterable

import torch

from kiln.config.memory_estimate import GiB

DEFAULT_CPU_KV_CACHE_GIB = 4.0


def bytes_per_block(block_shapes: Iterable[tuple[int, ...]], dtype: torch.dtype) -> int:
    """One block across every layer; block_shapes: each layer's cache shape at one block (its
    backend's: K and V, [2, 1, bs, nkv, hd], or an MLA latent alone, [1, 1, bs, 1, hd])."""
    return sum(math.prod(shape) for shape in block_shapes) * dtype.itemsize


def cpu_kv_cache_bytes(kv_cache_memory_gib: float | None, env_gib: float | None) -> int:
    """CPU budget: cache_config.kv_cache_memory, else KILN_CPU_KVCACHE_SPACE, else 4 GiB."""
    for gib in (kv_cache_memory_gib, env_gib):
        if gib is not None:
            return int(gib * GiB)
    return int(DEFAULT_CPU_KV_CACHE_GIB * GiB)


def cuda_kv_cache_bytes(total: int, used: int, gpu_memory_utilization: float,
                        kv_cache_memory_gib: float | None = None) -> int:
    """CUDA budget: cache_config.kv_cache_memory when set (as vLLM's --kv-cache-memory, it
    replaces the utilisation share), else the utilisation share of the device minus what is in
    use after profiling (weights, peak activations held by the allocator, other engines and
    processes)."""
    if kv_cache_memory_gib is not None:
        return int(kv_cache_memory_gib * GiB)
    return int(gpu_memory_utilization * total) - used


def num_blocks_for(budget_bytes: int, block_bytes: int) -> int:
    return max(budget_bytes, 0) // block_bytes


def useful_block_cap(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks past this only hold extra prefix cache: twice what max_num_seqs full-length
    sequences can use at once. Caps the CPU cache so a small model does not map gigabytes it
    cannot use."""
    return 2 * max_num_seqs * -(-max_model_len // block_size)


def cpu_budget_warning(cache_bytes: int, available_bytes: int, ranks: int = 1) -> str | None:
    """A warning when the CPU KV cache could outgrow the memory available at start-up. Its
    pages are committed as blocks are first used (host_memory.zeros_on_first_touch), so such a
    cache starts fine and runs out of memory later, under load. `ranks`: the ranks on this
    machine, each with a cache of `cache_bytes` (the budget is per rank, as in vLLM)."""
    total = cache_bytes * ranks
    if total <= available_bytes:
        return None
    what = (f"the KV cache ({total / GiB:.2f} GiB)" if ranks == 1 else
            f"the KV caches of the {ranks} ranks on this machine ({cache_bytes / GiB:.2f} GiB "
            f"each, {total / GiB:.2f} GiB together)")
    return (f"{what} {'is' if ranks == 1 else 'are'} larger than the memory available now "
            f"({available_bytes / GiB:.2f} GiB): committed as blocks are first used, so the "
            "process may run out of memory under load")
