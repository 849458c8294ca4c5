"""OLMo-2/3's q / k RMSNorm over a whole projection under tensor parallelism: each rank holds its
heads' share of the row and of the weight; the mean square is summed over the ranks (vLLM
gathers the whole projection instead: an all-reduce of one float per token does it)."""
import torch
from torch import nn

from kiln.distributed.communication_op import tensor_model_parallel_all_reduce
from kiln.model.layers.layernorm import F32ScaleRMSNorm
from kiln.model.layers.linear import default_weight_loader, take_shard


class ShardedF32ScaleRMSNorm(nn.Module):
    """F32ScaleRMSNorm (Olmo2RMSNorm) of a row split over `tp_size` ranks, this rank holding
    `size` of it, the `shard`-th of `num_shards` (KV heads replicated over more ranks than heads
    share a shard). Every rank holds as many elements and each element is held by as many
    ranks, so the mean of the ranks' mean squares is the whole row's."""

    def __init__(self, size: int, eps: float, shard: int, num_shards: int, tp_size: int):
        super().__init__()
        self.eps, self.size, self.tp_size = eps, size, tp_size
        self.shard, self.num_shards = shard, num_shards
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, take_shard(loaded, 0, self.shard, self.size,
                                                self.num_shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, size] -> normed [T, size], x's dtype."""
        x32 = x.to(torch.float32)
        mean_square = x32.pow(2).mean(-1, keepdim=True)  # [T, 1]
        mean_square = tensor_model_parallel_all_reduce(mean_square) / self.tp_size
        normed = x32 * torch.rsqrt(mean_square + self.eps)
        return (self.weight.to(torch.float32) * normed).to(x.dtype)


def whole_projection_norms(qkv_proj, eps: float) -> tuple[nn.Module, nn.Module]:
    """(q_norm, k_norm) over all of q's / k's heads for this rank's share of `qkv_proj`: the
    IR op's norm at one rank, the sharded one past it."""
    q_size, kv_size = qkv_proj.q_size, qkv_proj.kv_size
    tp_rank, tp_size, replicas = qkv_proj.tp_rank, qkv_proj.tp_size, qkv_proj.kv_replicas
    if tp_size == 1:
        return F32ScaleRMSNorm(q_size, eps), F32ScaleRMSNorm(kv_size, eps)
    return (ShardedF32ScaleRMSNorm(q_size, eps, tp_rank, tp_size, tp_size),
            ShardedF32ScaleRMSNorm(kv_size, eps, tp_rank // replicas, tp_size // replicas,
                                   tp_size))
