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



def test_warm_up_collects_garbage_only_after_compiling_or_tracing():
    from kiln.compilation.counters import CompilationCounter
    from kiln.config import CompilationMode
    from kiln.worker.worker import warm_up_left_garbage

    before = CompilationCounter(num_inductor_compiles=3, num_dynamo_traces=1)
    loaded = CompilationCounter(num_inductor_compiles=3, num_dynamo_traces=1,
                                num_compiled_artifacts_loaded=31, num_saved_graph_loads=1)
    for mode in (CompilationMode.NONE, CompilationMode.KILN_COMPILE):
        assert not warm_up_left_garbage(mode, before, loaded)  # a warm start: loads only
        assert warm_up_left_garbage(mode, before, CompilationCounter(num_inductor_compiles=4,
                                                                     num_dynamo_traces=1))
        assert warm_up_left_garbage(mode, before, CompilationCounter(num_inductor_compiles=3,
                                                                     num_dynamo_traces=2))
    # Stock torch.compile compiles through Dynamo's own machinery, which no counter sees.
    assert warm_up_left_garbage(CompilationMode.STOCK_TORCH_COMPILE, before, loaded)
