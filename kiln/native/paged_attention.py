"""Python entry point of csrc/paged_attention.c: causal attention read straight from the paged
KV cache, for the CPU attention backend's short queries (decodes, small chunks).
"""
import ctypes

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


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, reqs: torch.Tensor, max_seq_len: int, scale: float,
                    out: torch.Tensor) -> None:
    """Fill out [T, nh, hd] for the tokens of requests `reqs` (int32) from q [T, nh, hd] and the
    paged caches [nb, bs, nkv, hd]; the int32 metadata is the step's (CPU tensors)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available; see the warning "
                           "logged when it was first requested")
    _, block_size, nkv, hd = key_cache.shape
    if not (key_cache.dtype == value_cache.dtype == out.dtype == q.dtype):
        raise TypeError(f"paged_attention needs one dtype, got q {q.dtype}, cache "
                        f"{key_cache.dtype}, out {out.dtype}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError(f"paged_attention: {name} must be [T, nh, hd] with contiguous heads")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("paged_attention: the KV caches must be contiguous")
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(f"paged_attention: max_seq_len {max_seq_len} needs more blocks than the "
                         f"block table's {block_table.shape[1]} columns")
    build.check(lib.kiln_paged_attention(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        _int32_ptr("block_table", block_table), block_table.stride(0),
        _int32_ptr("query_start_loc", query_start_loc), _int32_ptr("seq_lens", seq_lens),
        _int32_ptr("reqs", reqs), reqs.numel(), out.data_ptr(), out.stride(0), q.shape[1], nkv,
        hd, block_size, max_seq_len, scale, build.DTYPES[q.dtype], torch.get_num_threads()),
        "kiln_paged_attention (1: a seq_len above max_seq_len or below its query length)")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, nkv, hd] (rows may be strided) into the caches [nb, bs, nkv, hd] at slot_mapping
    [T] (int64; -1 writes nowhere), all in one kernel dtype."""
    num_blocks, block_size, nkv, hd = key_cache.shape
    if not (k.dtype == v.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"write_kv_cache needs one dtype, got k {k.dtype}, v {v.dtype}, cache "
                        f"{key_cache.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1:] != (nkv, hd) or t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError(f"write_kv_cache: {name} must be [T, {nkv}, {hd}] with contiguous "
                             f"rows, got shape {tuple(t.shape)} strides {t.stride()}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("write_kv_cache: the KV caches must be contiguous")
    if (slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or slot_mapping.shape != k.shape[:1] or v.shape[0] != k.shape[0]):
        raise ValueError(f"write_kv_cache: slot_mapping must be contiguous int64 with one slot "
                         f"per token ({k.shape[0]} and {v.shape[0]} k/v rows), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    rc = _lib().kiln_write_kv_cache(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0],
        num_blocks * block_size, nkv * hd, build.DTYPES[k.dtype])
    if rc == 1:
        raise IndexError(f"write_kv_cache: a slot is outside [-1, {num_blocks * block_size}) "
                         "(the cache's blocks x block_size)")
    build.check(rc, "kiln_write_kv_cache")
