"""Compile-time accounting and log lines: trace time, per-shape compile/load time, cache state.

`compile_report()` gives the totals (also used by `kiln compile`); `section` marks a part of
them as another model's (a speculative draft's compile), which `split_section` takes apart.
"""
import contextlib
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
    # each cache directory opened, in order: (path, "hit" | "miss"); a list, not a dict by
    # path, so a second start-up in this process that opens the same one again shows it
    cache_opens: list[tuple[str, str]] = field(default_factory=list)
    inductor_cache_dir: str | None = None  # where the latest opened cache keeps Inductor's
    # {"name", "start", "end"}: the compile state around a `section` block
    sections: list[dict] = field(default_factory=list)


stats = CompileStats()


def log_trace(prefix: str, seconds: float) -> None:
    stats.trace_s += seconds
    logger.info("Dynamo traced %s in %.2f s", prefix, seconds)


def log_graph_load(prefix: str, seconds: float) -> None:
    """A saved traced graph replaced the Dynamo trace; its load counts as loading."""
    stats.load_s += seconds
    logger.info("loaded the saved graph of %s in %.2f s (no Dynamo trace)", prefix, seconds)


def log_cache_dir(path, warm: bool, inductor_dir=None) -> None:
    stats.cache_opens.append((str(path), "hit" if warm else "miss"))
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


def _snapshot() -> dict:
    from kiln.compilation.counters import compilation_counter
    from kiln.compilation.passes import pass_manager

    s = stats
    return {"counters": asdict(compilation_counter),
            "pass_runs": list(pass_manager.RUNS), "events": list(s.events),
            "cache_opens": list(s.cache_opens), "cache_dirs": dict(s.cache_opens),
            "inductor_cache_dir": s.inductor_cache_dir,
            "trace_s": s.trace_s, "compile_s": s.compile_s, "load_s": s.load_s}


def process_compile_state() -> dict:
    """What this process's compile stack has done so far: counters, pass runs, per-piece events,
    cache directories and times (a rank answers `compile_stats` with it), and its sections."""
    return {**_snapshot(), "sections": list(stats.sections)}


@contextlib.contextmanager
def section(name: str):
    """What the compile stack does inside the block is `name`'s: a speculative draft compiles
    in the target's process, and `kiln compile` reports the two apart."""
    start = _snapshot()
    try:
        yield
    finally:
        stats.sections.append({"name": name, "start": start, "end": _snapshot()})


_TIMES = ("trace_s", "compile_s", "load_s")
_RUNS = ("pass_runs", "events", "cache_opens")  # lists only ever appended to


def state_since(after: dict, before: dict | None) -> dict:
    """The part of `after` (a process_compile_state) that came after `before` (None: all)."""
    if before is None:
        return {k: v for k, v in after.items() if k != "sections"}
    runs = {k: after[k][len(before[k]):] for k in _RUNS}
    return {"counters": {k: v - before["counters"][k] for k, v in after["counters"].items()},
            **runs, "cache_dirs": dict(runs["cache_opens"]),
            "inductor_cache_dir": after["inductor_cache_dir"],
            **{k: after[k] - before[k] for k in _TIMES}}


def split_section(after: dict, before: dict | None, name: str) -> tuple[dict, dict | None]:
    """state_since(after, before) less the latest section `name` recorded in between, and that
    section's own part (None: no such section)."""
    whole = state_since(after, before)
    new = after.get("sections", [])[len(before["sections"]) if before else 0:]
    found = [sec for sec in new if sec["name"] == name]
    if not found:
        return whole, None
    start, end = found[-1]["start"], found[-1]["end"]
    part = state_since(end, start)
    rest = {**whole,
            "counters": {k: v - part["counters"][k] for k, v in whole["counters"].items()},
            # the latest cache opened before the section (the section's own otherwise)
            "inductor_cache_dir": start["inductor_cache_dir"] or whole["inductor_cache_dir"],
            **{k: whole[k] - part[k] for k in _TIMES}}
    for key in _RUNS:  # the section's entries are a run of the lists
        i = len(start[key]) - (len(before[key]) if before else 0)
        rest[key] = whole[key][:i] + whole[key][i + len(part[key]):]
    rest["cache_dirs"] = dict(rest["cache_opens"])
    return rest, part
