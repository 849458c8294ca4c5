"""DeepSeek's Multi-head Latent Attention: queries (through a low-rank q_a / q_b pair where
q_lora_rank is set), one latent per token (kv_a_proj_with_mqa: kv_lora_rank dims, normed, and a
rope part shared by every head), expanded per head by kv_b_proj into K's nope part and V.

The paged cache holds only the latent and the roped k_pe per token (vLLM's MLA layout:
kiln/attention/mla_backend.py). Every step, prefill included, runs the weight-absorbed form
(vLLM's decode form): q_nope through kv_b_proj's K part (W_UK) into the latent space, MQA over
the latent, the output through its V part (W_UV); kv_b_proj is never applied to the cache.
"""
import torch
from torch import nn

from kiln import ir
from kiln.attention.mla_backend import LatentAttentionBackend, LatentAttentionImpl
from kiln.config import get_current_kiln_config
from kiln.config.rope import get_rope_config, max_positions_of
from kiln.model.checkpoint_names import config_bias
from kiln.model.layers.attention import Attention
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _split
from kiln.model.layers.rotary_embedding import InterleavedRotaryEmbedding, RotaryEmbedding
from kiln.model.layers.yarn import yarn_softmax_mscale

# HF's q_a_layernorm / kv_a_layernorm are built without the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(Attention):
    """The attention op over a latent cache: num_heads absorbed queries of latent + rope dims
    against one KV head of the same, out [T, num_heads * latent] (V: the keys' latent part)."""

    def __init__(self, num_heads: int, latent: int, rope: int, scale: float, prefix: str):
        self.latent = latent
        super().__init__(num_heads, latent + rope, scale, 1, prefix)

    def _choose_backend(self):
        return LatentAttentionBackend

    def _new_impl(self):
        return LatentAttentionImpl(self.num_heads, self.head_size, self.scale, self.latent)

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads * self.latent)  # [T, nh * latent]
        ir.unified_attention(q, kv, kv, out, self.layer_name)
        return out


class MLAttention(nn.Module):
    def __init__(self, hf_config, prefix: str):
        super().__init__()
        hidden, total_heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.nope, self.rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = hf_config.v_head_dim, hf_config.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        bias = config_bias(hf_config, "attention_bias")
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_dim,
                                                 False)
        else:
            # the checkpoint's q_proj (renamed on load: Kiln's q_proj names a part of qkv_proj)
            self.q_heads_proj = ColumnParallelLinear(hidden, total_heads * self.qk_dim, False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_heads * (self.nope + self.v_dim), False)
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias)
        # only its weight is read (absorbed into the queries and the output): no packed copy
        self.kv_b_proj.supports_cpu_packing = False
        self.num_heads = _split(total_heads, self.kv_b_proj.tp_size, "num_attention_heads")
        theta, scaling = get_rope_config(hf_config)
        # V2 (HF: complex products, always) and V3 with rope_interleave (its default) rotate
        # interleaved pairs; V3 without it, each head's halves
        interleaved = getattr(hf_config, "model_type", "") != "deepseek_v3" or bool(
            getattr(hf_config, "rope_interleave", True))
        rotary_cls = InterleavedRotaryEmbedding if interleaved else RotaryEmbedding
        self.rotary_emb = rotary_cls(self.rope, max_positions_of(hf_config), theta, scaling,
                                     get_current_kiln_config().model_config.max_model_len)
        # q_latent . c_kv is q_nope . k_nope: the expanded form's scale
        scale = self.qk_dim ** -0.5 * yarn_softmax_mscale(scaling)
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.rope, scale,
                                    prefix=f"{prefix}.attn")

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_heads_proj(x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens, nh = x.shape[0], self.num_heads
        q = self._queries(x).view(num_tokens, nh, self.qk_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, kv_lora_rank]
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.nope:].reshape(num_tokens, nh * self.rope),
                                     k_pe.contiguous())  # [T, nh * rope], [T, rope]: one head
        # this rank's heads of kv_b_proj: W_UK [nh, nope, L] and W_UV [nh, v, L]
        w_uk, w_uv = self.kv_b_proj.weight.view(nh, self.nope + self.v_dim,
                                                self.kv_lora_rank).split([self.nope, self.v_dim], 1)
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk)  # [nh, T, L]
        q = torch.cat((q_latent.transpose(0, 1), q_pe.view(num_tokens, nh, self.rope)), dim=-1)
        kv = torch.cat((latent, k_pe), dim=-1)  # [T, L + rope]: the cache row
        out = self.attn(q.reshape(num_tokens, -1), kv)  # [T, nh * L]
        out = torch.bmm(out.view(num_tokens, nh, self.kv_lora_rank).transpose(0, 1),
                        w_uv.transpose(1, 2))  # [nh, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, nh * self.v_dim))
