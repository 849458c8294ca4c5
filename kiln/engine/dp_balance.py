"""The choice of data-parallel replica for a new request (as vLLM's DPLB client: fewest waiting,
then fewest running requests), and a replica's load as the front end can know it between steps.
"""
from collections.abc import Sequence


def replica_load(stats_waiting: int, stats_running: int, unseen_adds: int,
                 num_unfinished: int) -> tuple[int, int]:
    """(waiting, running) of one replica. `stats_*`: its scheduler's counts as of its latest
    step; `unseen_adds`: requests sent since that step's inputs (they wait, as far as we know);
    `num_unfinished`: requests the front end has in it now. The stats lag: a request aborted (a
    cancelled stream) or finished since then still counts there, and an idle replica sends no
    fresh ones, so what the front end knows caps them."""
    running = max(0, min(stats_running, num_unfinished))
    waiting = max(0, min(stats_waiting + unseen_adds, num_unfinished - running))
    return waiting, running


def pick_replica(loads: Sequence[tuple[int, int]], start: int = 0) -> int:
    """The index of the replica with the fewest waiting, then running requests; a tie goes to
    the first at or after `start` (a caller turning `start` spreads equal replicas' requests)."""
    if not loads:
        raise ValueError("no data-parallel replica to pick from")
    n = len(loads)
    order = [(start + k) % n for k in range(n)]
    return min(order, key=lambda i: loads[i])
