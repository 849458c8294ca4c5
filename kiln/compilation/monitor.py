"""Compile-time accounting and log lines: trace time, per-shape compile/load time, cache state.

`compile_report()` gives the totals (also used by `kiln compile`).
"""
import time
from dataclasses import dataclass, field

from kiln.logger import init_logger

logger = init_logger("kiln.compilation")


@dataclass
class CompileStats:
    trace_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    events: list[dict] = field(default_factory=list)  # one per (piece, shape)
    cache_dirs: dict[str, str] = field(default_factory=dict)  # cache dir -> "hit" | "miss"


stats = CompileStats()


def log_trace(prefix: str, seconds: float) -> None:
    stats.trace_s += seconds
    logger.info("Dynamo traced %s in %.2f s", prefix, seconds)


def log_graph_load(prefix: str, seconds: float) -> None:
    """A saved traced graph replaced the Dynamo trace; its load counts as loading."""
    stats.load_s += seconds
    logger.info("loaded the saved graph of %s in %.2f s (no Dynamo trace)", prefix, seconds)


def log_cache_dir(path, warm: bool) -> None:
    stats.cache_dirs[str(path)] = "hit" if warm else "miss"
    logger.info("compile cache %s: %s", "hit" if warm else "miss", path)


def log_piece(piece: int, shape: int | None, action: str, seconds: float) -> None:
    """action: "compiled", "loaded" or "reused" (an identical piece compiled it already)."""
    if action == "loaded":
        stats.load_s += seconds
    else:
        stats.compile_s += seconds
    label = "range" if shape is None else f"size {shape}"
    stats.events.append({"piece": piece, "shape": label, "action": action, "s": seconds})
    logger.debug("piece %d (%s) %s in %.2f s", piece, label, action, seconds)


def log_total() -> None:
    counts = {a: sum(e["action"] == a for e in stats.events) for a in ("compiled", "loaded",
                                                                         "reused")}
    logger.info("torch.compile took %.2f s in all (trace %.2f s, compile %.2f s, load %.2f s; "
                "%d compiled, %d loaded, %d reused)", stats.trace_s + stats.compile_s +
                stats.load_s, stats.trace_s, stats.compile_s, stats.load_s, counts["compiled"],
                counts["loaded"], counts["reused"])


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
