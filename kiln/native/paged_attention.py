"""Python entry point of the CPU paged-attention kernel (`kiln::paged_attention`, csrc/
attention_op.cpp over paged_attention.c): one call per layer writes the step's K/V into the paged
cache and attends the short queries (decodes, small chunks) straight from it.

What is fixed for a step (`StepArgs`: its metadata tensors) is gathered once and shared by every
layer; the op checks its tensors each call (in C++).
"""
import functools

import torch

from kiln.attention.kv_cache_dtype import is_fp8
from kiln.native import build


def available() -> bool:
    return build.available()


@functools.cache  # fixed for the process: the library is built for this machine's CPU
def bf16_dot(dtype: torch.dtype, head_size: int) -> bool:
    """Whether a decode's bfloat16 query . key products, and its weights . values with the
    softmax weights rounded to bfloat16, run on AVX512-BF16 dot products for this cache dtype and
    head size (bfloat16 or fp8, head sizes a multiple of 32, the library built for a CPU with
    AVX512-BF16); otherwise on float32 FMAs."""
    return available() and bool(torch.ops.kiln.paged_attention_bf16_dot(dtype, head_size))


def cache_supported(kv_cache: torch.Tensor, q_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel reads this layer's cache [2, nb, bs, nkv, hd] as it is (float32,
    bfloat16 or an fp8 cache), for queries of q_dtype where given (the cache's own dtype, or
    float32 / bfloat16 over an fp8 cache)."""
    fp8 = is_fp8(kv_cache.dtype)
    if q_dtype is not None and q_dtype != kv_cache.dtype and not (fp8 and q_dtype in build.DTYPES):
        return False
    return (kv_cache.device.type == "cpu" and (kv_cache.dtype in build.DTYPES or fp8)
            and kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous())


class StepArgs:
    """One step's metadata (CPU tensors) as the kernel takes it: every layer of the step shares
    it. The requests `reqs` (int32) are those attended; the first num_tokens tokens' k/v are
    written at slot_mapping (int64; -1 writes nowhere)."""
    __slots__ = ("block_table", "query_start_loc", "seq_lens", "reqs", "slot_mapping",
                 "num_tokens", "max_seq_len", "block_size")

    def __init__(self, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, reqs: torch.Tensor, max_seq_len: int, block_size: int,
                 slot_mapping: torch.Tensor, num_tokens: int):
        if max_seq_len > block_table.shape[1] * block_size:
            raise ValueError(f"paged_attention: max_seq_len {max_seq_len} needs more blocks than "
                             f"the block table's {block_table.shape[1]} columns")
        self.block_table, self.query_start_loc, self.seq_lens = block_table, query_start_loc, seq_lens
        self.reqs, self.slot_mapping = reqs, slot_mapping
        self.num_tokens, self.max_seq_len, self.block_size = num_tokens, max_seq_len, block_size

    def tensors(self) -> tuple:
        """(block_table, query_start_loc, seq_lens, reqs, slot_mapping, num_tokens,
        max_seq_len): the ops' step arguments, in their order."""
        return (self.block_table, self.query_start_loc, self.seq_lens, self.reqs,
                self.slot_mapping, self.num_tokens, self.max_seq_len)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        kv_cache: torch.Tensor, step: StepArgs, scale: float, window: int | None = None,
        softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k, v [T, nkv*hd] into kv_cache [2, nb, bs, nkv, hd] at the step's slots, then fill
    out [T, nh*hd] for the step's requests from q [T, nh*hd] and the cache. Rows may be strided
    (column slices of the fused qkv projection); the other rows of out are left alone.
    window: a query sees only the last `window` keys (its own included); softcap: the scaled
    scores become softcap * tanh(score / softcap) (Gemma-2). k_scale, v_scale: an fp8 cache's
    (stored = x / scale, read = stored * scale; kiln/attention/kv_cache_scales.py)."""
    if not build.available():
        raise RuntimeError("the CPU paged-attention kernel is not available; see the warning "
                           "logged when it was first requested")
    torch.ops.kiln.paged_attention(q, k, v, out, kv_cache, scale, *step.tensors(), window or 0,
                                   softcap or 0.0, k_scale, v_scale)
