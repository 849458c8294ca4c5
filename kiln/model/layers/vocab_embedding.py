"""Token embedding and the LM head, split by vocabulary across tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding): the embedding sums
the ranks' lookups with one all-reduce; the head gathers every rank's logits for sampling.
The head may tie its weight to the embedding's, as SmolLM and small Qwen models do; a tied
embedding whose head keeps a GGUF file's blocks then looks its rows up in those blocks.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln import ir
from kiln.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kiln.errors import ConfigError
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
        # the tied head's GGUF blocks, when the lookup reads them (embed_from_head_blocks)
        self.register_buffer("table_blocks", None, persistent=False)
        self.table_qtype = 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ConfigError(f"weight shape mismatch: parameter ({self.num_embeddings}, "
                              f"{self.embedding_dim}) (whole vocabulary) vs checkpoint "
                              f"{tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        default_weight_loader(param.data.narrow(0, 0, rows),
                              loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()  # padding rows: zero logits, sliced off after the gather

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table_blocks is not None:
            return ir.gguf_embedding(input_ids, self.table_blocks, self.table_qtype,
                                     self.num_embeddings, self.embedding_dim,
                                     self.weight.dtype)  # [T, H]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, H]
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        hidden = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(hidden)  # [T, H]


class ParallelLMHead(EagerCall, VocabParallelEmbedding):
    """The LM head; `bias` (Phi's lm_head): a bias per vocabulary row, split with the rows
    (zero on the padding rows), never tied."""
    supports_cpu_packing = True  # see kiln/model/layers/cpu_gemm.py
    call_fields = cpu_gemm.CALL_FIELDS

    def __init__(self, *args, bias: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.rows_per_rank), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)
        cpu_gemm.init_cpu_forms(self)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings,):
            raise ConfigError(f"weight shape mismatch: LM head bias ({self.num_embeddings},) "
                              f"(vocab_size) vs checkpoint {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        default_weight_loader(param.data.narrow(0, 0, rows),
                              loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def _build_call(self) -> tuple:
        return cpu_gemm.linear_call(self, self.bias)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._call(hidden).float()  # [N, V / tp]
        if self.tp_size == 1:
            return logits
        # [N, rows_per_rank * tp] in rank order -> drop the padding rows' columns
        return tensor_model_parallel_all_gather(logits, dim=-1)[:, :self.num_embeddings]


def embed_from_head_blocks(model: nn.Module) -> bool:
    """Let a tied embedding look its rows up in the LM head's GGUF blocks (the IR op
    gguf_embedding, exact: the values the dense weight was dequantized to), so that nothing
    reads the dense weight and cpu_gemm.release_dense_copies lets it go; True if it does.
    Only where the native kernel is bound: the reference decodes a group of 16 rows an id."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not (isinstance(embed, VocabParallelEmbedding) and isinstance(head, ParallelLMHead)
            and head.weight is embed.weight and embed.tp_size == 1
            and getattr(head, "cpu_blocks", None) is not None):
        return False
    if ir.gguf_embedding.chosen(embed.weight.device.type, embed.weight.dtype) != "native":
        return False
    embed.table_blocks, embed.table_qtype = head.cpu_blocks, head.cpu_qtype
    return True
