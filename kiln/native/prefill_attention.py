"""Python entry point of the CPU prefill kernel (`kiln::prefill_attention`, csrc/
prefill_attention.c): blocked causal attention of long queries read from the paged KV cache.

The step's K/V must be in the cache already (`paged_attention.run` writes every token's); this
only attends, one call per layer for all of the step's long queries.
"""
import functools

import torch

from kiln.native import build
from kiln.native.paged_attention import StepArgs


@functools.cache  # fixed for the process: the library is built for this machine's CPU
def simd(dtype: torch.dtype, head_size: int) -> bool:
    """Whether the kernel's SIMD tiles (AVX512-BF16 / AVX512F) serve this dtype and head size on
    this machine; otherwise its scalar path does (correct, slower)."""
    return bool(torch.ops.kiln.prefill_attention_simd(dtype, head_size))


@functools.cache
def amx(dtype: torch.dtype, head_size: int) -> bool:
    """Whether AMX-BF16 tiles serve this dtype and head size on this machine (bfloat16, head
    sizes a multiple of 32, a CPU with AMX whose OS grants the tiles); they then take the
    place of the AVX512-BF16 tiles."""
    return bool(torch.ops.kiln.prefill_attention_amx(dtype, head_size))


# The kernel's code paths (csrc/kernels.h): the fastest that serves, the AVX512 tiles even where
# AMX's serve, the scalar loop. Tests run each; the engine takes the first.
PATHS = {"best": 0, "avx512": 1, "portable": 2}


def run(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, step: StepArgs, scale: float,
        path: str = "best", window: int | None = None, softcap: float | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Fill out [T, nh*hd] for the step's requests `step.reqs` from q [T, nh*hd] and kv_cache
    [2, nb, bs, nkv, hd]; rows may be strided, other rows of out are left alone. path: one of
    PATHS (tests pin the slower ones); window, softcap and the scales as paged_attention.run's."""
    if not build.available():
        raise RuntimeError("the CPU prefill-attention kernel is not available; see the warning "
                           "logged when it was first requested")
    torch.ops.kiln.prefill_attention(q, out, kv_cache, scale, step.block_table,
                                     step.query_start_loc, step.seq_lens, step.reqs,
                                     step.max_seq_len, PATHS[path], window or 0, softcap or 0.0,
                                     k_scale, v_scale)
