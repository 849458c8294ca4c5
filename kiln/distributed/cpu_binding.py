"""Which cores a CPU engine's OpenMP threads may use, as vLLM-CPU decides it: ranks on one
machine share its cores evenly or take the lists given (VLLM_CPU_OMP_THREADS_BIND), and a
served engine leaves cores to its front end (VLLM_CPU_NUM_OF_RESERVED_CPU).
"""
import os

import torch

from kiln import envs
from kiln.errors import ConfigError


def _name() -> str:
    """The variable the binding was read from, for errors (vLLM's where Kiln's is unset)."""
    return envs.source("KILN_CPU_OMP_THREADS_BIND")


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
            raise ConfigError(f"{_name()}: {part!r} in {spec!r} is not a core "
                              "number or range like 0-3") from None
    repeated = sorted({c for c in cores if cores.count(c) > 1})
    if repeated:  # one thread per listed core: a repeat puts two threads on one core
        raise ConfigError(f"{_name()}: {spec!r} lists core {repeated[0]} more "
                          "than once; list each core of a rank once")
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
        raise ConfigError(f"{_name()}={bind!r} gives {len(lists)} core list(s) "
                          f"for {local_world_size} ranks on this machine; give one per rank, "
                          "separated by '|', or use auto / nobind")
    return parse_core_list(lists[local_rank])


def replica_binding(bind: str, replica: int, num_replicas: int, world_size: int) -> str:
    """The binding of data-parallel replica `replica`'s ranks, as vLLM-CPU splits it: `auto`
    and `nobind` as they are; a list of cores per rank gives every replica its own, in turn
    (replica d's rank r takes list d * world_size + r), so replicas never share cores."""
    if bind in ("auto", "nobind") or num_replicas == 1:
        return bind
    lists = bind.split("|")
    needed = num_replicas * world_size
    if len(lists) != needed:
        raise ConfigError(f"{_name()}={bind!r} gives {len(lists)} core list(s); "
                          f"--data-parallel-size {num_replicas} x {world_size} rank(s) per "
                          f"replica needs {needed}, one per rank separated by '|' (replica 0's "
                          "ranks first), or use auto / nobind")
    return "|".join(lists[replica * world_size:(replica + 1) * world_size])


def threads_left(threads: int, reserved: int) -> int:
    """OpenMP threads an engine keeps when `reserved` of its `threads` cores go to the front
    end: at least one."""
    return max(1, threads - reserved)


def cores_to_leave(requested: int, device: str, model_here: bool, guarded: bool) -> int:
    """How many of the `requested` cores an engine core can leave to its front end: none
    unless the model runs on CPU in this process (ranks in their own processes keep their
    KILN_CPU_OMP_THREADS_BIND cores) and its compiled code has no guards (mode 1's Dynamo
    guards the thread count: a change would recompile, which serving refuses)."""
    return requested if device == "cpu" and model_here and not guarded else 0


def leave_cores_to_front_end(reserved: int) -> tuple[int, int] | None:
    """Shrink this process's torch thread pool by `reserved` cores, after the model compiled
    and warmed up with all of them (so what is compiled and cached is the same as `LLM`'s).
    A user's OMP_NUM_THREADS is kept. (threads before, after), or None where unchanged."""
    if reserved <= 0 or os.environ.get("OMP_NUM_THREADS"):
        return None
    before = torch.get_num_threads()
    after = threads_left(before, reserved)
    if after == before:
        return None
    torch.set_num_threads(after)
    return before, after


def checked_cores(bind: str, local_rank: int, local_world_size: int,
                  available: list[int]) -> list[int] | None:
    """cores_for_rank, refusing cores the process may not run on: sched_setaffinity's bare
    "Invalid argument" named neither the rank nor the cores."""
    cores = cores_for_rank(bind, local_rank, local_world_size, available)
    missing = sorted(set(cores or ()) - set(available))
    if missing:
        raise ConfigError(f"{_name()}={bind!r}: rank {local_rank}'s cores "
                          f"{missing} are not available to it (available: {available}); "
                          "name cores of this machine, or use auto / nobind")
    return cores


def check_binding(bind: str, local_world_size: int, num_replicas: int = 1) -> None:
    """Every rank's cores (of every data-parallel replica) checked in the front end, before
    any rank starts (a bad list was each rank's traceback, stacked)."""
    if hasattr(os, "sched_getaffinity"):
        available = sorted(os.sched_getaffinity(0))
        for replica in range(num_replicas):
            mine = replica_binding(bind, replica, num_replicas, local_world_size)
            for rank in range(local_world_size):
                checked_cores(mine, rank, local_world_size, available)


def bind_this_process(bind: str, local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin this process to its cores and size torch's thread pool to them (before anything
    compiles: the thread count is part of Dynamo's global-state guard)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = checked_cores(bind, local_rank, local_world_size, sorted(os.sched_getaffinity(0)))
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
