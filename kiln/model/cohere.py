"""Cohere Command-R (CohereForCausalLM): Llama's projections and SiLU-gated MLP in a parallel
block (parallel_block.py) under one LayerNorm without a bias, rope over each head's interleaved
pairs (HF's Cohere rotate_half), logits times `logit_scale`, the head tied by default, and
(`use_qk_norm`, Command-R+) a LayerNorm on q and k with a weight of its own per head.

The checkpoint's names are Llama's, so LoRA's q/k/v/o, gate/up/down adapters apply.
"""
import torch
from torch import nn

from kiln import ir
from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.layernorm import LayerNorm
from kiln.model.layers.linear import default_weight_loader, take_shard
from kiln.model.layers.rotary_embedding import InterleavedRotaryEmbedding
from kiln.model.llama import LlamaAttention, LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.parallel_block import ParallelBlockDecoderLayer


class CohereLayerNorm(LayerNorm):
    """HF's CohereLayerNorm: a weight, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps, bias=False)


class HeadLayerNorm(nn.Module):
    """Cohere's q / k norm: a LayerNorm over each head's dims with a weight per head
    ([heads, head_dim]; this rank's `heads` of it, the `shard`-th of `num_shards`),
    normalised and scaled in float32 before rounding, as HF's CohereLayerNorm."""

    def __init__(self, heads: int, head_dim: int, eps: float, shard: int, num_shards: int):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.shard, self.num_shards = shard, num_shards
        self.weight = nn.Parameter(torch.ones(heads, head_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # the unit weight the layer_norm op scales by before the per-head weight
        self.register_buffer("unit", torch.ones(head_dim, dtype=torch.float32),
                             persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, take_shard(loaded, 0, self.shard, self.heads,
                                                self.num_shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x3 = x.reshape(num_tokens, self.heads, self.head_dim).to(torch.float32)
        normed = ir.layer_norm(x3, self.unit, None, self.eps) * self.weight.to(torch.float32)
        return normed.to(x.dtype).view(num_tokens, self.heads * self.head_dim)


class CohereAttention(LlamaAttention):
    rotary_cls = InterleavedRotaryEmbedding

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.use_qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
        if self.use_qk_norm:
            qkv, eps = self.qkv_proj, hf_config.layer_norm_eps
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, eps, qkv.tp_rank,
                                        qkv.tp_size)
            # KV heads replicated over ranks (more ranks than heads) share one shard
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, eps,
                                        qkv.tp_rank // qkv.kv_replicas,
                                        qkv.tp_size // qkv.kv_replicas)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(x)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [T, nh*hd], [T, nkv*hd]
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class CohereDecoderLayer(ParallelBlockDecoderLayer):
    attention_cls = CohereAttention
    norm_cls = CohereLayerNorm


@support_torch_compile
class CohereModel(LlamaStyleModel):
    layer_cls = CohereDecoderLayer


class CohereForCausalLM(LlamaStyleForCausalLM):
    model_cls = CohereModel

    def __init__(self, *, kiln_config, prefix: str = ""):
        super().__init__(kiln_config=kiln_config, prefix=prefix)
        scale = getattr(self.config, "logit_scale", None)
        self.logit_scale = 1.0 if scale is None else float(scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale  # [N, V] float32
