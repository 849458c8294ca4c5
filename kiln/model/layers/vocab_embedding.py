"""Token embedding and the LM head (tp_size 1; shaped so vocab sharding can come later).

The head may tie its weight to the embedding's, as SmolLM and small Qwen models do.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kiln.model.layers.cpu_gemm  # noqa: F401  (registers torch.ops.kiln.linear)
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
    use_packed_gemm = False

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.use_packed_gemm:
            return torch.ops.kiln.linear(hidden, self.weight, None).float()  # [N, V]
        return F.linear(hidden, self.weight).float()  # [N, V]
