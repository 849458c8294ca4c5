"""KV cache sizing arithmetic: bytes per block, CPU budget precedence, CUDA budget."""
import torch

from kiln.worker import kv_cache_sizing as kvs


def test_bytes_per_block_sums_layers():
    # 2 (K, V) * 16 tokens * 8 heads * 64 dims * 2 bytes, per layer, two layers
    kv = (2, 1, 16, 8, 64)
    assert kvs.bytes_per_block([kv, kv], torch.bfloat16) == 2 * 2 * 16 * 8 * 64 * 2
    assert kvs.bytes_per_block([(2, 1, 16, 2, 128)], torch.float32) == 2 * 16 * 2 * 128 * 4
    # an MLA layer's latent cache (kiln/attention/mla_backend.py): no V
    assert kvs.bytes_per_block([(1, 1, 16, 1, 576)], torch.bfloat16) == 16 * 576 * 2


def test_cpu_budget_precedence():
    assert kvs.cpu_kv_cache_bytes(1.5, 8.0) == int(1.5 * kvs.GiB)
    assert kvs.cpu_kv_cache_bytes(None, 2.0) == 2 * kvs.GiB
    assert kvs.cpu_kv_cache_bytes(None, None) == 4 * kvs.GiB


def test_cuda_budget_and_block_count():
    total = 80 * kvs.GiB
    budget = kvs.cuda_kv_cache_bytes(total, used=20 * kvs.GiB, gpu_memory_utilization=0.5)
    assert budget == 20 * kvs.GiB
    assert kvs.num_blocks_for(budget, kvs.GiB // 4) == 80
    # Over budget already: no blocks rather than a negative count.
    assert kvs.num_blocks_for(kvs.cuda_kv_cache_bytes(total, 79 * kvs.GiB, 0.5), 1024) == 0
    # --kv-cache-memory replaces the share, whatever else is on the device (a second engine).
    assert kvs.cuda_kv_cache_bytes(total, 79 * kvs.GiB, 0.5, kv_cache_memory_gib=2.5) == \
        int(2.5 * kvs.GiB)


def test_cpu_budget_warning_only_past_available_memory():
    assert kvs.cpu_budget_warning(4 * kvs.GiB, 4 * kvs.GiB) is None
    warning = kvs.cpu_budget_warning(6 * kvs.GiB, 2 * kvs.GiB)
    assert "6.00 GiB" in warning and "2.00 GiB" in warning
    # the budget is per rank: two ranks on one machine commit it twice (helper-51)
    assert kvs.cpu_budget_warning(3 * kvs.GiB, 4 * kvs.GiB, ranks=1) is None
    warning = kvs.cpu_budget_warning(3 * kvs.GiB, 4 * kvs.GiB, ranks=2)
    assert "2 ranks on this machine (3.00 GiB each, 6.00 GiB together)" in warning


def test_cpu_platform_reports_available_and_total_memory():
    from kiln.platforms.interface import CpuPlatform

    available, total = CpuPlatform().mem_get_info()
    assert 0 < available <= total


def test_cpu_kvcache_space_env_is_checked(monkeypatch):
    import pytest

    from kiln import envs

    monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", "2.5")
    assert envs.cpu_kvcache_space_gib() == 2.5
    for bad in ("abc", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match=rf"KILN_CPU_KVCACHE_SPACE='{bad}' must be a finite"):
            envs.cpu_kvcache_space_gib()
    monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", "")
    assert envs.cpu_kvcache_space_gib() is None


def test_kv_cache_memory_is_a_finite_positive_size():
    import pytest

    from kiln.config.cache_config import CacheConfig

    assert CacheConfig(kv_cache_memory=0.5).kv_cache_memory == 0.5
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--kv-cache-memory"):
            CacheConfig(kv_cache_memory=bad)
