"""Wall time this rank spends inside collectives and point-to-point transfers, per kind.

The benchmarks read it (through the executor) to report the per-step cost of communication.
"""
import time
from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)


class timed:
    """`with timed("all_reduce"): ...` adds the block's wall time to that kind's total."""

    __slots__ = ("kind", "start")

    def __init__(self, kind: str):
        self.kind = kind

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        _seconds[self.kind] += time.perf_counter() - self.start
        _calls[self.kind] += 1


def snapshot() -> dict[str, dict[str, float]]:
    """{kind: {"seconds": total, "calls": n}} since the last reset."""
    return {k: {"seconds": _seconds[k], "calls": _calls[k]} for k in sorted(_seconds)}


def reset() -> None:
    _seconds.clear()
    _calls.clear()
