"""The IR's collective, `kiln::all_reduce`: the sum of a tensor over a process group (the TP
group after each row-parallel linear and the vocab-parallel embedding).

One node in a compiled graph, kept as it is by the lowering pass (its implementation is a call
into torch.distributed, not torch code to inline), so an all-reduce + add + RMSNorm fusion can
match it later. Functional: the result is a new tensor.
"""
import torch
import torch.distributed as dist

from kiln.distributed.comm_timing import timed
from kiln.distributed.parallel_state import get_group
from kiln.ir.op import Implementation, define


def _all_reduce_ref(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """x [..., hidden] -> the sum over the ranks of group `group_name` ("tp") of their x."""
    out = x.contiguous().clone()
    group = get_group(group_name)
    if group.world_size > 1:
        with timed("all_reduce"):
            dist.all_reduce(out, group=group.group)
    return out


def _all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


all_reduce = define(
    "all_reduce", "(Tensor x, str group_name) -> Tensor", _all_reduce_ref, _all_reduce_fake,
    lambda dtype, device: (torch.randn(2, 64, dtype=dtype, device=device), "tp"))
# The reference is the implementation (gloo on CPU, NCCL on CUDA); in a graph the node stays.
all_reduce.register(Implementation("torch", _all_reduce_ref, graph_op=all_reduce.packet))
