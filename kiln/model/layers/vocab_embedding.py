"""Token embedding and the LM head, split by vocabulary across tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding): the embedding sums
the ranks' lookups with one all-reduce; the head gathers every rank's logits for sampling.
The head may tie its weight to the embedding's, as SmolLM and small Qwen models do.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kiln.model.layers import cpu_gemm
from kiln.model.layers.eager_call import EagerCall
from kiln.model.layers.linear import default_weight_loader, tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight shape mismatch: parameter ({self.num_embeddings}, "
                             f"{self.embedding_dim}) (whole vocabulary) vs checkpoint "
                             f"{tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        default_weight_loader(param.data.narrow(0, 0, rows),
                              loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()  # padding rows: zero logits, sliced off after the gather

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, H]
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        hidden = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(hidden)  # [T, H]


class ParallelLMHead(EagerCall, VocabParallelEmbedding):
    supports_cpu_packing = True  # see kiln/model/layers/cpu_gemm.py
    call_fields = cpu_gemm.CALL_FIELDS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cpu_gemm.init_cpu_forms(self)

    def _build_call(self) -> tuple:
        return cpu_gemm.linear_call(self, None)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._call(hidden).float()  # [N, V / tp]
        if self.tp_size == 1:
            return logits
        # [N, rows_per_rank * tp] in rank order -> drop the padding rows' columns
        return tensor_model_parallel_all_gather(logits, dim=-1)[:, :self.num_embeddings]
