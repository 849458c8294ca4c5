"""Host memory: keeping the start-up heap out of the garbage collector's scans, zero-filled CPU
buffers whose pages are only committed when written, and a malloc that keeps what a step frees.
"""
import ctypes
import ctypes.util
import gc
import math
import mmap
import sys

import torch

from kiln import envs
from kiln.logger import init_logger

logger = init_logger(__name__)

# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def freeze_gc_heap(collect: bool = False) -> None:
    """Move every object alive now out of the garbage collector's reach, until shutdown.

    Start-up builds a large heap that lives as long as the engine (imported modules, the model,
    compiled graphs). Left tracked, each full collection rescans all of it: 0.1-0.2 s a time,
    about 0.85 s of a warm start of the default model on 2 cores, one collection inside the
    compile window. Frozen, later collections only scan what was allocated since.
    `collect=True` first frees the cyclic garbage that compiling leaves, which freezing would
    otherwise keep.
    """
    if collect:
        gc.collect()
    gc.freeze()


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous mapping, whose pages the OS supplies zero-filled
    when first written. torch.zeros writes every page at once: the default 4 GiB CPU KV budget
    took 1.0 s of start-up and all of its memory before any request used a block. A page's
    first write now costs ~0.8 us (a new block of the default model: ~150 us over its 30
    layers), once. The mapping is private: Python's default, a shared one, is shmem, whose
    first writes cost ~40% more and never get transparent huge pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive (torch.frombuffer holds the buffer).
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def keep_freed_heap() -> bool:
    """Have glibc's malloc keep memory the process frees for its next allocations, so that a
    step's activations (a prefill's [2048, 3072] gate-up output is 12 MB) reuse pages already
    mapped. By default a block that size is its own mmap, returned on free, and its every page
    faults again on the next step; the heap's top is trimmed likewise. Measured on a 2-core
    Xeon: a linear, SiLU-and-mul and a second linear at prefill sizes took ~6,800 page faults
    per iteration by default and none after this. Blocks above 32 MB (glibc's largest mmap
    threshold) are still mapped per allocation: an allocator such as tcmalloc through
    LD_PRELOAD keeps those too. `KILN_CPU_MALLOC_TUNING=0` leaves malloc as it was. Returns
    whether it applied (glibc on Linux)."""
    if not envs.cpu_malloc_tuning() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    applied = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
    if not applied:
        logger.debug("mallopt refused a setting; malloc keeps its defaults for those")
    return applied
