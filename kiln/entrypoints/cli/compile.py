"""`kiln compile`: compile and warm the cache for a model (all the engine does before serving),
then print what the compile stack did: pieces, shapes, per-shape times, cache, counters.
"""
import argparse
import json

from kiln.engine.arg_utils import EngineArgs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile and warm the compile cache for a model; print a report",
        description="Build the engine (load the model, size the KV cache, compile and warm up "
                    "every shape) and report the chosen implementation of every IR op, pieces, "
                    "shapes, per-shape compile/load times, the cache directory, hits and "
                    "misses, and Inductor compiles vs loads.")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object instead of text")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _pass_totals(r: dict) -> str:
    """Each pass's rewrites summed over the cold piece compiles of `r` (a report or a rank's)."""
    totals: dict[str, int] = {}
    for run in r.get("pass_runs", []):
        for name, n in run["matches"].items():
            totals[name] = totals.get(name, 0) + n
    if not totals:
        return ""
    return (", ".join(f"{name} {n}" for name, n in totals.items())
            + f" rewrites over {len(r['pass_runs'])} cold piece compiles")


def _piece_lines(r: dict) -> list[str]:
    """Pieces, shapes, cache, passes and Inductor of a piecewise compile (the target's or a
    draft's section of the report)."""
    c = r["cache"]
    lines = []
    p = r["pieces"]
    lines.append(f"pieces     {p['total']} total, {p['compiled']} compiled (split at "
                 f"{', '.join(r['splitting_ops']) or 'nothing'})")
    lo, hi = r["shapes"]["range"]
    sizes = ", ".join(map(str, r["shapes"]["compile_sizes"])) or "none"
    lines.append(f"shapes     range [{lo}, {hi}]; compile sizes: {sizes}")
    for i, row in enumerate(r["per_shape"]):
        parts = [f"{row[a]} {a}" for a in ("compiled", "loaded", "reused") if row[a]]
        lines.append(f"{'per shape' if i == 0 else '':<10} {row['shape']:<10} "
                     f"{', '.join(parts)}; compile {_s(row['compile_s'])}, load "
                     f"{_s(row['load_s'])}")
    if not c["enabled"]:
        lines.append("cache      disabled (KILN_DISABLE_COMPILE_CACHE)")
    for path, state in c["dirs"].items():
        lines.append(f"cache      {path} [{state}]")
    lines.append(f"           {c['hits']} hits, {c['misses']} misses, {c['corrupt']} corrupt "
                 f"artifacts; Inductor cache {c['inductor_cache_dir']}")
    if _pass_totals(r):
        lines.append(f"passes     {_pass_totals(r)}")
    ind = r["inductor"]
    lines.append(f"inductor   {ind['compiles']} compiles, {ind['artifacts_loaded']} artifacts "
                 f"loaded, {ind['artifacts_saved']} saved")
    return lines


def format_report(r: dict) -> str:
    """The human-readable report (pure: tests check it on a hand-made dict)."""
    t = r["times"]
    lines = [f"model      {r['model']} ({r['architecture']}, {r['num_layers']} layers) on "
             f"{r['device']}, {r['dtype']}",
             f"mode       {r['compilation_mode']} ({r['compilation_mode_name']}), backend "
             f"{r['backend']}"]
    if r.get("ir_ops"):  # the model's ops only (a float model calls no int8 op)
        used = r.get("ir_ops_used", r["ir_ops"])
        lines.append("ir ops     " + ", ".join(f"{op} {r['ir_ops'][op]}" for op in sorted(used)))
    piecewise = r["compilation_mode"] == 3
    if r["compilation_mode"] == 0:
        lines.append("           nothing compiled (mode 0 runs eagerly)")
    elif not piecewise:  # torch.compile's own path: no pieces, no Kiln cache to report
        lines.append("           plain torch.compile, without Kiln's split, shapes or cache; "
                     "its compile time is in the warm-up below")
    else:
        lines += _piece_lines(r)
        captured = r["counters"].get("num_cudagraph_captured", 0)
        if captured:
            lines.append(f"cudagraphs {captured} captured")
        for rank in r.get("ranks", []):  # each rank compiled its own graphs (above: rank 0's)
            p, ind = rank["pieces"], rank["inductor"]
            lines.append(f"{'ranks' if rank is r['ranks'][0] else '':<10} rank {rank['rank']}: "
                         f"{p['total']} pieces, {p['compiled']} compiled, {ind['compiles']} "
                         f"Inductor compiles; passes {_pass_totals(rank) or 'none ran'}")
            # the ranks share Inductor's cache: a graph another rank compiled first is found
            # there, already rewritten, and its passes do not run (nor count) again
            cached = ind["compiles"] - len(rank["pass_runs"])
            if cached > 0:
                lines.append(f"{'':<10} rank {rank['rank']}: {cached} of its compiles found in "
                             "Inductor's cache (a graph another rank compiled and rewrote)")
    if "draft" in r:  # compiled in the same process, reported apart from the target
        lines += _draft_lines(r["draft"])
    lines.append(f"time       total {_s(t['total_s'])}: config {_s(t['config_s'])}, load model "
                 f"{_s(t.get('load_model_s'))}, profile + KV cache "
                 f"{_s(t.get('profile_kv_cache_s'))}, warm-up {_s(t.get('warmup_s'))}")
    if piecewise:
        lines.append(f"           of which Dynamo trace {_s(t['trace_s'])}, compile "
                     f"{_s(t['compile_s'])}, artifact load {_s(t['artifact_load_s'])}")
    return "\n".join(lines)


def _draft_lines(d: dict) -> list[str]:
    lines = [f"draft      {d['model']} ({d['method']}, {d['architecture']}, {d['num_layers']} "
             f"layers), mode {d['compilation_mode']} ({d['compilation_mode_name']})"]
    if d["compilation_mode"] != 3:
        return lines + ["           nothing compiled (the draft runs eagerly)"]
    t = d["times"]
    return lines + [f"  {line}" for line in _piece_lines(d)] + [
        f"  time     Dynamo trace {_s(t['trace_s'])}, compile {_s(t['compile_s'])}, artifact "
        f"load {_s(t['load_s'])}"]


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.compile import compile_report

    report = compile_report(EngineArgs.from_cli_args(args))
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0
