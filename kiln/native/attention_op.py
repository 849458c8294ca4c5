"""Python side of csrc/attention_op.cpp, the C++ CPU kernel of `kiln::unified_attention`: loading
it, and handing it each step's plan and an engine's table of layers.

The C++ kernel serves a step's layers only once a step was handed over (`begin_step`), and only
those in the table; every other call goes to the Python implementation, as before.
"""
import ctypes
import functools
import weakref

import torch

from kiln.native import build, paged_attention

KINDS = ("kernel", "python")  # the C++ kernel's calls: served there, sent to Python


@functools.cache
def available() -> bool:
    """The C++ kernel built and loaded, holding the C kernel's address; False (with one
    warning) when either cannot be built."""
    lib = paged_attention._lib()
    if lib is None or not build.load_torch_op("attention_op"):
        return False
    torch.ops.kiln._cpu_attention_set_kernel(
        ctypes.cast(lib.kiln_paged_attention, ctypes.c_void_p).value)
    return True


class LayerTable:
    """An engine's layers as the C++ kernel finds them by name: each one's KV cache (held
    weakly there), its `paged_attention.CacheArgs` (held here: the kernel keeps its address)
    and scale."""

    def __init__(self, layers: dict[str, tuple[torch.Tensor, paged_attention.CacheArgs, float]]):
        self.caches = [cache for _, cache, _ in layers.values()]
        self.handle = torch.ops.kiln._cpu_attention_bind(
            list(layers), [kv_cache for kv_cache, _, _ in layers.values()],
            [cache.address for cache in self.caches],
            [float(scale) for _, _, scale in layers.values()])
        weakref.finalize(self, torch.ops.kiln._cpu_attention_unbind, self.handle)


def begin_step(table: LayerTable, step: paged_attention.StepArgs, num_actual_tokens: int) -> None:
    """Until `end_step`, calls for the table's layers attend with `step`, which (like the
    table) the caller keeps alive; rows from num_actual_tokens on are padding, zeroed."""
    torch.ops.kiln._cpu_attention_set_step(table.handle, step.address, num_actual_tokens)


def end_step() -> None:
    torch.ops.kiln._cpu_attention_set_step(0, 0, 0)


def call_counts() -> dict[str, int]:
    """The C++ kernel's calls so far (process-wide) by where they were served."""
    return dict(zip(KINDS, torch.ops.kiln._cpu_attention_call_counts()))
