"""The collectives model code and the runner call: the tensor-parallel all-reduce (the IR op
`kiln::all_reduce`, kiln/ir/collectives.py: one node in a compiled graph), the logits all-gather,
and the pipeline's point-to-point sends of hidden states.

Each is the identity (or a no-op) in a group of one, so single-rank graphs contain none.
"""
import torch
import torch.distributed as dist

from kiln import ir
from kiln.distributed.comm_timing import timed
from kiln.distributed.parallel_state import get_pp_group, get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the tensor-parallel group (x itself when it has one rank)."""
    if get_tp_group().world_size == 1:
        return x
    return ir.all_reduce(x, "tp")


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every TP rank's x concatenated along `dim`, in rank order (eager only: the logits)."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    with timed("all_gather"):
        dist.all_gather(parts, x, group=group.group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Send this stage's outputs (hidden, residual) to the same TP rank of the next stage."""
    pp = get_pp_group()
    with timed("pp_send"):
        for t in tensors:
            dist.send(t.contiguous(), dst=pp.next_rank)


def recv_from_prev_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype,
                         device: torch.device) -> list[torch.Tensor]:
    """Receive the previous stage's outputs, of known shapes (every rank knows the step's
    token count from the scheduler output)."""
    pp = get_pp_group()
    out = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    with timed("pp_recv"):
        for t in out:
            dist.recv(t, src=pp.prev_rank)
    return out


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """The last stage's `t` on every stage of this rank's pipeline (the sampled tokens, which
    the earlier stages feed back as the next step's inputs); t is overwritten in place."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return t
    with timed("pp_broadcast"):
        dist.broadcast(t, src=pp.ranks[-1], group=pp.group)
    return t
