"""Token embedding and the LM head (tp_size 1; shaped so vocab sharding can come later).

The head may tie its weight to the embedding's, as SmolLM and small Qwen models do.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln import ir
from kiln.model.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T, H]


class ParallelLMHead(VocabParallelEmbedding):
    supports_cpu_packing = True  # see kiln/model/layers/cpu_gemm.py

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ir.linear(hidden, self.weight, None).float()  # [N, V]
