"""Compile-time accounting and log lines: trace time, per-shape compile/load time, cache state.

`compile_report()` gives the totals (also used by `kiln compile`).
"""
import time
from dataclasses import asdict, dataclass, field

from kiln.logger import init_logger

logger = init_logger("kiln.compilation")


@dataclass
class CompileStats:
    trace_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    events: list[dict] = field(default_factory=list)  # one per (piece, shape)
    cache_dirs: dict[str, str] = field(default_factory=dict)  # cache dir -> "hit" | "miss"
    inductor_cache_dir: str | None = None  # where the latest opened cache keeps Inductor's


stats = CompileStats()


def log_trace(prefix: str, seconds: float) -> None:
    stats.trace_s += seconds
    logger.info("Dynamo traced %s in %.2f s", prefix, seconds)


def log_graph_load(prefix: str, seconds: float) -> None:
    """A saved traced graph replaced the Dynamo trace; its load counts as loading."""
    stats.load_s += seconds
    logger.info("loaded the saved graph of %s in %.2f s (no Dynamo trace)", prefix, seconds)


def log_cache_dir(path, warm: bool, inductor_dir=None) -> None:
    stats.cache_dirs[str(path)] = "hit" if warm else "miss"
    if inductor_dir is not None:
        stats.inductor_cache_dir = str(inductor_dir)
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


def per_shape(events: list[dict]) -> list[dict]:
    """Events (one per piece and shape) grouped by shape: range first, then sizes ascending."""
    rows: dict[str, dict] = {}
    for e in events:
        row = rows.setdefault(e["shape"], {"shape": e["shape"], "compiled": 0, "loaded": 0,
                                           "reused": 0, "compile_s": 0.0, "load_s": 0.0})
        row[e["action"]] += 1
        row["load_s" if e["action"] == "loaded" else "compile_s"] += e["s"]

    def order(label: str):
        return (0, 0) if label == "range" else (1, int(label.removeprefix("size ")))

    out = [rows[k] for k in sorted(rows, key=order)]
    for row in out:
        row["compile_s"], row["load_s"] = round(row["compile_s"], 4), round(row["load_s"], 4)
    return out


def log_total(since: int = 0) -> None:
    """The process's totals, and one line per shape for the events from index `since` on."""
    for row in per_shape(stats.events[since:]):
        logger.info("shape %s: %d compiled in %.2f s, %d loaded in %.2f s, %d reused",
                    row["shape"], row["compiled"], row["compile_s"], row["loaded"],
                    row["load_s"], row["reused"])
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


def process_compile_state() -> dict:
    """What this process's compile stack has done so far: counters, pass runs, per-piece events,
    cache directories and times (a rank answers `compile_stats` with it)."""
    from kiln.compilation.counters import compilation_counter
    from kiln.compilation.passes import pass_manager

    s = stats
    return {"counters": asdict(compilation_counter),
            "pass_runs": list(pass_manager.RUNS), "events": list(s.events),
            "cache_dirs": dict(s.cache_dirs), "inductor_cache_dir": s.inductor_cache_dir,
            "trace_s": s.trace_s, "compile_s": s.compile_s, "load_s": s.load_s}
