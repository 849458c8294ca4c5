"""The KV cache write over the OpenMP threads (kv_cache_write.c): when a step's rows are split
(`kv_cache_write_threads`) and that the split write leaves the cache byte for byte as the serial
one and the torch path, for bfloat16 and fp8 caches, over shuffled slots with -1 padding."""
import pytest
import torch

from kiln.attention.torch_backend import write_kv_cache
from kiln.native import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.available(), reason="no C compiler")


def threads_for(num_tokens: int, row_bytes: int, num_threads: int) -> int:
    return torch.ops.kiln.kv_cache_write_threads(num_tokens, row_bytes, num_threads)


def test_a_decode_step_stays_on_the_calling_thread_and_a_prefill_splits():
    row = 3 * 64 * 2  # the default model's K (or V) row: 3 kv heads of 64 bfloat16
    assert threads_for(32, row, 2) == 1  # a decode step of 32 rows: no parallel region
    assert threads_for(1, row, 16) == 1
    assert threads_for(0, row, 2) == 1
    assert threads_for(2048, row, 2) == 2  # a prefill step
    assert threads_for(2048, row, 1) == 1
    assert threads_for(2048, row, 0) == 1  # never fewer than the calling thread
    assert threads_for(2048, row, 64) == 6  # no more threads than the bytes pay for
    assert threads_for(1 << 20, row, 64) == 64
    # monotonic in the rows: a bigger write never takes fewer threads
    counts = [threads_for(n, row, 8) for n in range(0, 8192, 97)]
    assert counts == sorted(counts)


def _write(k, v, cache, slots, k_scale, v_scale):
    n = k.shape[0]
    step = pa.StepArgs(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                       torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0,
                       cache.shape[2], slots, n)
    pa.run(k, k, v, torch.empty_like(k), cache, step, 1.0, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_split_write_gives_the_serial_writes_bytes(kv_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nkv, hd, bs, n = 2, 64, 16, 4096
    num_blocks = n // bs + 40
    # shuffled distinct slots over more blocks than the rows fill, about a tenth padding (-1)
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.1] = -1
    k = (torch.randn(n, nkv * hd, generator=g) * 3).to(torch.bfloat16)
    v = (torch.randn(n, nkv * hd, generator=g) * 3).to(torch.bfloat16)
    k_scale, v_scale = (0.5, 1.7) if kv_dtype != torch.bfloat16 else (1.0, 1.0)
    # a cache of random bytes: padding and untouched slots must keep theirs
    before = torch.randint(0, 120, (2, num_blocks, bs, nkv, hd), dtype=torch.uint8, generator=g)
    if kv_dtype == torch.bfloat16:
        before = torch.randn(2, num_blocks, bs, nkv, hd, generator=g).to(kv_dtype).view(torch.uint8)
    row_bytes = nkv * hd * before.view(kv_dtype).element_size()
    assert threads_for(n, row_bytes, 2) == 2

    threads = torch.get_num_threads()
    caches = {}
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            cache = before.clone().view(kv_dtype)
            start = torch.ops.kiln.kv_cache_parallel_writes()
            _write(k, v, cache, slots, k_scale, v_scale)
            assert torch.ops.kiln.kv_cache_parallel_writes() - start == num_threads - 1
            caches[num_threads] = cache
    finally:
        torch.set_num_threads(threads)
    want = before.clone().view(kv_dtype)
    write_kv_cache(k.view(n, nkv, hd), v.view(n, nkv, hd), want, slots, k_scale=k_scale,
                   v_scale=v_scale)
    assert torch.equal(caches[2].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), want.view(torch.uint8))
