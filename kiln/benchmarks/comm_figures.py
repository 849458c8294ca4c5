"""Per-step communication figures of a multi-rank run, from the executor's comm_stats: time in
collectives per rank and kind, and in delivering the scheduler output to the ranks.
"""


def comm_figures(stats: dict | None) -> dict:
    """{} for one rank; else per-step milliseconds (steps = scheduler outputs delivered)."""
    if not stats:
        return {}
    steps = max(1, stats["scheduler_output_broadcasts"])
    ranks = {}
    for rank in stats["ranks"]:
        kinds = {kind: {"ms_per_step": 1e3 * v["seconds"] / steps,
                        "calls_per_step": v["calls"] / steps}
                 for kind, v in rank["comm"].items()}
        ranks[str(rank["rank"])] = {
            "collectives_ms_per_step": sum(k["ms_per_step"] for k in kinds.values()),
            "by_kind": kinds,
            "scheduler_output_unpickle_ms_per_step":
                1e3 * rank["scheduler_output_unpickle_s"] / steps}
    return {"steps": stats["scheduler_output_broadcasts"],
            # the engine's side: pickling once and writing to every rank (mp) / object store (ray)
            "scheduler_output_send_ms_per_step":
                1e3 * stats["scheduler_output_broadcast_s"] / steps,
            "ranks": ranks}
