"""Python entry point of csrc/paged_attention.c: causal attention read straight from the paged
KV cache, for the CPU attention backend's short queries (decodes, small chunks).
"""
import ctypes
from typing import NamedTuple

import torch

from kiln.native import build

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
SIGNATURES = (("kiln_paged_attention", (_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I32, _P, _I64,
                                        _I32, _I32, _I32, _I32, _I32, ctypes.c_float, _I32,
                                        _I32)),
              ("kiln_write_kv_cache", (_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I32)))


def _lib() -> ctypes.CDLL | None:
    return build.load("paged_attention", SIGNATURES)


def available() -> bool:
    return _lib() is not None


def _int32_ptr(name: str, t: torch.Tensor) -> int:
    if t.dtype != torch.int32 or t.stride(-1) != 1:
        raise ValueError(f"paged_attention: {name} must be int32 with contiguous rows, got "
                         f"{t.dtype} with strides {t.stride()}")
    return t.data_ptr()


class CacheArgs(NamedTuple):
    """A layer's paged K/V caches [nb, bs, nkv, hd] as the kernels take them, checked once."""
    key: int  # data pointers
    value: int
    num_slots: int  # nb * bs
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


def cache_args(key_cache: torch.Tensor, value_cache: torch.Tensor) -> CacheArgs:
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in build.DTYPES:
        raise TypeError(f"paged_attention: the caches need one kernel dtype, got key "
                        f"{key_cache.dtype}, value {value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("paged_attention: the KV caches must be contiguous")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: key cache {tuple(key_cache.shape)} and value cache "
                         f"{tuple(value_cache.shape)} differ")
    num_blocks, block_size, nkv, hd = key_cache.shape
    return CacheArgs(key_cache.data_ptr(), value_cache.data_ptr(), num_blocks * block_size, nkv,
                     hd, block_size, key_cache.dtype)


class StepArgs(NamedTuple):
    """One step's int32 metadata for the requests a call computes, checked once: every layer
    of the step shares it."""
    block_table: int  # data pointers, then the table's row stride
    block_table_stride: int
    query_start_loc: int
    seq_lens: int
    reqs: int
    num_reqs: int
    max_seq_len: int


def step_args(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              reqs: torch.Tensor, max_seq_len: int, block_size: int) -> StepArgs:
    """The int32 metadata (CPU tensors) of the requests `reqs` (int32) as kernel arguments."""
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(f"paged_attention: max_seq_len {max_seq_len} needs more blocks than the "
                         f"block table's {block_table.shape[1]} columns")
    return StepArgs(_int32_ptr("block_table", block_table), block_table.stride(0),
                    _int32_ptr("query_start_loc", query_start_loc),
                    _int32_ptr("seq_lens", seq_lens), _int32_ptr("reqs", reqs), reqs.numel(),
                    max_seq_len)


def attend(q: torch.Tensor, cache: CacheArgs, step: StepArgs, scale: float,
           out: torch.Tensor) -> None:
    """Fill out [T, nh, hd] for the step's requests from q [T, nh, hd] and the paged caches."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available; see the warning "
                           "logged when it was first requested")
    hd = cache.head_size
    if not (q.dtype == out.dtype == cache.dtype):
        raise TypeError(f"paged_attention needs one dtype, got q {q.dtype}, cache "
                        f"{cache.dtype}, out {out.dtype}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != hd or t.shape[2] != hd:
            raise ValueError(f"paged_attention: {name} must be [T, nh, {hd}] with contiguous "
                             "heads")
    build.check(lib.kiln_paged_attention(
        q.data_ptr(), q.stride(0), cache.key, cache.value, step.block_table,
        step.block_table_stride, step.query_start_loc, step.seq_lens, step.reqs, step.num_reqs,
        out.data_ptr(), out.stride(0), q.shape[1], cache.num_kv_heads, hd, cache.block_size,
        step.max_seq_len, scale, build.DTYPES[q.dtype], torch.get_num_threads()),
        "kiln_paged_attention (1: a seq_len above max_seq_len or below its query length)")


def write(k: torch.Tensor, v: torch.Tensor, cache: CacheArgs,
          slot_mapping: torch.Tensor) -> None:
    """k, v [T, nkv, hd] (rows may be strided) into the caches at slot_mapping [T] (int64; -1
    writes nowhere), all in the caches' dtype."""
    nkv, hd = cache.num_kv_heads, cache.head_size
    if not (k.dtype == v.dtype == cache.dtype):
        raise TypeError(f"write_kv_cache needs one dtype, got k {k.dtype}, v {v.dtype}, cache "
                        f"{cache.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1:] != (nkv, hd) or t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError(f"write_kv_cache: {name} must be [T, {nkv}, {hd}] with contiguous "
                             f"rows, got shape {tuple(t.shape)} strides {t.stride()}")
    if (slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or slot_mapping.shape != k.shape[:1] or v.shape[0] != k.shape[0]):
        raise ValueError(f"write_kv_cache: slot_mapping must be contiguous int64 with one slot "
                         f"per token ({k.shape[0]} and {v.shape[0]} k/v rows), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    rc = _lib().kiln_write_kv_cache(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache.key, cache.value,
        slot_mapping.data_ptr(), k.shape[0], cache.num_slots, nkv * hd, build.DTYPES[k.dtype])
    if rc == 1:
        raise IndexError(f"write_kv_cache: a slot is outside [-1, {cache.num_slots}) "
                         "(the cache's blocks x block_size)")
    build.check(rc, "kiln_write_kv_cache")

