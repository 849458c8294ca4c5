"""Which cores a CPU rank's OpenMP threads may use, as vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND
decides it: ranks on one machine share its cores evenly, or take the lists given.
"""
import os

import torch


def parse_core_list(spec: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cores: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.extend(range(lo, hi + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise ValueError(f"KILN_CPU_OMP_THREADS_BIND: {part!r} in {spec!r} is not a core "
                             "number or range like 0-3") from None
    return cores


def cores_for_rank(bind: str, local_rank: int, local_world_size: int,
                   available: list[int]) -> list[int] | None:
    """The cores of `local_rank` among `local_world_size` ranks on this machine; None: leave the
    process as it is (`nobind`). `auto` splits `available` into equal consecutive shares (each
    rank at least one core, shares reused when ranks outnumber cores)."""
    if bind == "nobind":
        return None
    if bind == "auto":
        available = sorted(available)
        share = max(1, len(available) // local_world_size)
        start = (local_rank * share) % len(available)
        return available[start:start + share]
    lists = bind.split("|")
    if len(lists) != local_world_size:
        raise ValueError(f"KILN_CPU_OMP_THREADS_BIND={bind!r} gives {len(lists)} core list(s) "
                         f"for {local_world_size} ranks on this machine; give one per rank, "
                         "separated by '|', or use auto / nobind")
    return parse_core_list(lists[local_rank])


def bind_this_process(bind: str, local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin this process to its cores and size torch's thread pool to them (before anything
    compiles: the thread count is part of Dynamo's global-state guard)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = cores_for_rank(bind, local_rank, local_world_size,
                           sorted(os.sched_getaffinity(0)))
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
