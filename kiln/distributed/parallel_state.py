"""The process groups of one rank: the world, its tensor-parallel group and its pipeline group.

Before (or without) `init_distributed` every group is this process alone (size 1, rank 0), so
single-process engines and unit tests build the same layers with no communication.
"""
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupInfo:
    """One group as this rank sees it: the global ranks in it, in order, and its own place."""
    name: str
    ranks: tuple[int, ...]
    rank_in_group: int
    group: object = None  # the torch ProcessGroup; None for a group of one

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def prev_rank(self) -> int:
        return self.ranks[self.rank_in_group - 1]

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]


_SINGLE = {"tp": GroupInfo("tp", (0,), 0), "pp": GroupInfo("pp", (0,), 0)}
_groups: dict[str, GroupInfo] = dict(_SINGLE)


def group_ranks(tp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, pipeline groups) as lists of global ranks, for
    rank = pp_rank * tp + tp_rank: a TP group is one stage's ranks; a PP group, one column."""
    tp_groups = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
    pp_groups = [list(range(t, tp * pp, tp)) for t in range(tp)]
    return tp_groups, pp_groups


def comm_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rank: int, tp: int, pp: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0) -> None:
    """Join the world of tp * pp ranks at `init_method` (tcp://host:port) and build the groups.
    Every rank calls this with the same sizes (new_group is collective)."""
    world = tp * pp
    if not dist.is_initialized():
        dist.init_process_group(comm_backend(device), init_method=init_method, world_size=world,
                                rank=rank, timeout=datetime.timedelta(seconds=timeout_s))
    tp_groups, pp_groups = group_ranks(tp, pp)
    for name, all_groups in (("tp", tp_groups), ("pp", pp_groups)):
        for ranks in all_groups:
            # Every rank creates every group, in the same order, keeping its own.
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                _groups[name] = GroupInfo(name, tuple(ranks), ranks.index(rank), group)


def model_parallel_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_group(name: str) -> GroupInfo:
    return _groups[name]


def get_tp_group() -> GroupInfo:
    return _groups["tp"]


def get_pp_group() -> GroupInfo:
    return _groups["pp"]


def destroy_model_parallel() -> None:
    _groups.update(_SINGLE)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
