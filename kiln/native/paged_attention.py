"""Python entry point of csrc/paged_attention.c: one call per layer writes the step's K/V into
the paged cache and attends the short queries (decodes, small chunks) straight from it.

What is fixed for a layer's cache (`CacheArgs`) or for a step (`StepArgs`) is checked once and
handed to C as a struct; a layer's call (`run`) checks and passes only its own tensors.
"""
import ctypes

import torch

from kiln.native import build

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
SIGNATURES = (("kiln_paged_attention", (_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I32,
                                        ctypes.c_float, _P, _P, _I32)),)
_ERRORS = {1: "a seq_len above max_seq_len or below its query length", 2: "out of memory",
           8: "num_heads not a multiple of num_kv_heads"}


def _lib() -> ctypes.CDLL | None:
    return build.load("paged_attention", SIGNATURES)


def available() -> bool:
    return _lib() is not None


def _int_ptr(name: str, t: torch.Tensor, dtype: torch.dtype) -> int:
    if t.dtype != dtype or t.stride(-1) != 1:
        raise ValueError(f"paged_attention: {name} must be {dtype} with contiguous rows, got "
                         f"{t.dtype} with strides {t.stride()}")
    return t.data_ptr()


class _KvCache(ctypes.Structure):  # csrc's KilnKvCache
    _fields_ = [("key", _P), ("value", _P), ("num_slots", _I64), ("num_kv_heads", _I32),
                ("head_size", _I32), ("block_size", _I32), ("dtype", _I32)]


class _Step(ctypes.Structure):  # csrc's KilnAttnStep
    _fields_ = [("block_table", _P), ("bt_stride", _I64), ("query_start", _P),
                ("seq_lens", _P), ("reqs", _P), ("slots", _P), ("num_tokens", _I64),
                ("num_sel", _I32), ("max_seq_len", _I32)]


class CacheArgs:
    """A layer's paged K/V caches [nb, bs, nkv, hd] as the kernel takes them, checked once.
    Only their addresses: the caller keeps the caches alive (the attention impl holds its cache
    weakly, so that a replaced cache is freed at once)."""
    __slots__ = ("struct", "address", "dtype", "num_kv_heads", "head_size", "block_size")

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor):
        if key_cache.dtype != value_cache.dtype or key_cache.dtype not in build.DTYPES:
            raise TypeError(f"paged_attention: the caches need one kernel dtype, got key "
                            f"{key_cache.dtype}, value {value_cache.dtype}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("paged_attention: the KV caches must be contiguous")
        if key_cache.shape != value_cache.shape:
            raise ValueError(f"paged_attention: key cache {tuple(key_cache.shape)} and value "
                             f"cache {tuple(value_cache.shape)} differ")
        num_blocks, block_size, nkv, hd = key_cache.shape
        self.struct = _KvCache(key_cache.data_ptr(), value_cache.data_ptr(),
                               num_blocks * block_size, nkv, hd, block_size,
                               build.DTYPES[key_cache.dtype])
        self.address = ctypes.addressof(self.struct)
        self.dtype, self.num_kv_heads, self.head_size = key_cache.dtype, nkv, hd
        self.block_size = block_size


class StepArgs:
    """One step's metadata (CPU tensors) as the kernel takes it, checked once: every layer of the
    step shares it. The requests `reqs` (int32) are those attended; the first num_tokens tokens'
    k/v are written at slot_mapping (int64; -1 writes nowhere). Holds the tensors: the struct
    points into them."""
    __slots__ = ("struct", "address", "num_tokens", "_tensors")

    def __init__(self, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, reqs: torch.Tensor, max_seq_len: int, block_size: int,
                 slot_mapping: torch.Tensor, num_tokens: int):
        if max_seq_len > block_table.shape[1] * block_size:
            raise ValueError(f"paged_attention: max_seq_len {max_seq_len} needs more blocks than "
                             f"the block table's {block_table.shape[1]} columns")
        if not (slot_mapping.is_contiguous() and 0 <= num_tokens <= slot_mapping.numel()):
            raise ValueError(f"paged_attention: slot_mapping must be contiguous with one slot per "
                             f"token ({num_tokens}), got {tuple(slot_mapping.shape)}")
        self.struct = _Step(_int_ptr("block_table", block_table, torch.int32),
                            block_table.stride(0),
                            _int_ptr("query_start_loc", query_start_loc, torch.int32),
                            _int_ptr("seq_lens", seq_lens, torch.int32),
                            _int_ptr("reqs", reqs, torch.int32),
                            _int_ptr("slot_mapping", slot_mapping, torch.int64),
                            num_tokens, reqs.numel(), max_seq_len)
        self.address = ctypes.addressof(self.struct)
        self.num_tokens = num_tokens
        self._tensors = (block_table, query_start_loc, seq_lens, reqs, slot_mapping)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cache: CacheArgs,
        step: StepArgs, scale: float) -> None:
    """Write k, v [T, nkv*hd] into the caches at the step's slots, then fill out [T, nh*hd] for
    the step's requests from q [T, nh*hd] and the caches. Rows may be strided (column slices of
    the fused qkv projection); the other rows of out are left alone."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available; see the warning "
                           "logged when it was first requested")
    kv_width = cache.num_kv_heads * cache.head_size
    width = q.shape[-1]
    for name, t, w in (("q", q, width), ("k", k, kv_width), ("v", v, kv_width),
                       ("out", out, width)):
        if (t.dtype != cache.dtype or t.dim() != 2 or t.shape[1] != w or t.stride(1) != 1
                or t.shape[0] < step.num_tokens):
            raise ValueError(f"paged_attention: {name} must be {cache.dtype} [>= "
                             f"{step.num_tokens}, {w}] with contiguous rows, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if width % cache.head_size:
        raise ValueError(f"paged_attention: q's width {width} is not whole heads of "
                         f"{cache.head_size} values")
    rc = lib.kiln_paged_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), width // cache.head_size, scale, cache.address,
        step.address, torch.get_num_threads())
    if rc & 4:
        raise IndexError(f"paged_attention: a slot is outside [-1, {cache.struct.num_slots}) "
                         "(the cache's blocks x block_size); nothing was written")
    if rc:
        raise RuntimeError(f"kiln_paged_attention failed with code {rc}: "
                           + ", ".join(m for bit, m in _ERRORS.items() if rc & bit))
