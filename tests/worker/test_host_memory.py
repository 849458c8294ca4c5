"""Lazily committed zero buffers (the CPU KV caches); the frozen heap is tested through a
dropped engine (tests/entrypoints/test_llm.py)."""
import gc
import os
import weakref

import pytest
import torch

from kiln.worker.host_memory import zeros_on_first_touch


def _resident_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_first_touch_is_a_writable_zero_tensor(dtype):
    x = zeros_on_first_touch((2, 7, 4, 3, 8), dtype)
    assert x.shape == (2, 7, 4, 3, 8) and x.dtype == dtype and x.is_contiguous()
    assert not x.any()
    x[1, 3] = 2.0
    assert float(x.float().sum()) == 2.0 * 4 * 3 * 8
    assert zeros_on_first_touch((0, 4), dtype).shape == (0, 4)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_zeros_on_first_touch_commits_only_what_is_written():
    before = _resident_mib()
    x = zeros_on_first_touch((256, 1 << 20), torch.float32)  # 1 GiB
    assert _resident_mib() - before < 64
    x[:16].fill_(1.0)  # 64 MiB written
    assert 48 < _resident_mib() - before < 160
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None and _resident_mib() - before < 32  # the mapping went with it

