"""CPU attention: the torch backend with short queries (decodes, small chunks) sent to the C kernel,
and the step's K/V written into the cache by one C call.

The kernel reads each request's K/V blocks in place, once; longer queries keep SDPA's blocked
kernel, which beats the kernel's per-token loop there.
"""
import torch

from kiln.native import build, paged_attention
from kiln.attention.backend import AttentionImpl
from kiln.attention.metadata import AttentionMetadata
from kiln.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl

# Queries up to this many tokens go to the kernel (a decode is 1). Measured on 2 cores (one
# request, 256 tokens of context, 9 heads of 64, ms per layer): kernel / SDPA (4-D, its flash
# kernel) 0.14-0.17 / 0.26-0.38 at 4 tokens, 0.22-0.28 / 0.33-0.41 at 8, 0.44-0.48 / 0.39-0.50
# at 16 (they meet), 0.69 / 0.59-0.60 at 24.
KERNEL_MAX_QUERY_LEN = 16


def split_requests(query_lens: list[int],
                   max_kernel_len: int = KERNEL_MAX_QUERY_LEN) -> tuple[list[int], list[int]]:
    """(requests for the kernel, requests for SDPA) by query length; empty queries in neither."""
    short = [i for i, n in enumerate(query_lens) if 0 < n <= max_kernel_len]
    long = [i for i, n in enumerate(query_lens) if n > max_kernel_len]
    return short, long


class CpuAttentionImpl(TorchAttentionImpl):
    def _write_kv(self, k, v, kv_cache, slot_mapping, step_cache) -> None:
        if k.dtype not in build.DTYPES or kv_cache.dtype != k.dtype:
            super()._write_kv(k, v, kv_cache, slot_mapping, step_cache)
            return
        paged_attention.write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def _attend(self, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        if q.dtype not in build.DTYPES or kv_cache.dtype != q.dtype:
            super()._attend(q, k, v, kv_cache, md, out)
            return
        short, long = self._plan(md)
        if short.numel():
            paged_attention.paged_attention(q, kv_cache[0], kv_cache[1], md.block_table,
                                            md.query_start_loc, md.seq_lens, short,
                                            md.max_seq_len, self.scale, out)
        if long:
            self._per_request(q, k, v, kv_cache, md, out, long)

    @staticmethod
    def _plan(md: AttentionMetadata) -> tuple[torch.Tensor, list[int]]:
        # Once per step, shared by every layer.
        if "cpu_split" not in md.step_cache:
            starts = md.query_start_loc_cpu[:md.num_reqs + 1].tolist()
            short, long = split_requests([e - s for s, e in zip(starts, starts[1:])])
            md.step_cache["cpu_split"] = (torch.tensor(short, dtype=torch.int32), long)
        return md.step_cache["cpu_split"]


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuAttentionImpl
