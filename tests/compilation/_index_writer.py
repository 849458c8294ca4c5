"""A process writing compile-cache index entries, for the concurrent-writers test: a module of
its own, so that each spawned writer imports the cache alone and not the test module's stack."""
from pathlib import Path

from kiln.compilation.cache import CompileCache


def record_many(args) -> None:
    cache_dir, worker = args
    cache = CompileCache(Path(cache_dir), "rank_0", "M")
    for i in range(20):
        cache.record(i, worker, "c", {"file": f"{worker}_{i}", "fingerprint": "f"})
