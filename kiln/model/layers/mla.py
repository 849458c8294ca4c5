"""DeepSeek's Multi-head Latent Attention: queries (through a low-rank q_a / q_b pair where
q_lora_rank is set), one latent per token (kv_a_proj_with_mqa: kv_lora_rank dims, normed, and a
rope part shared by every head), expanded per head by kv_b_proj into K's nope part and V.

The paged cache holds the expanded per-head K (nope + rope) and V, through the ordinary attention
op: V is zero-padded to K's head size (the op needs one head size) and the padding dropped from
its output. Storing the compressed latent (vLLM's MLA cache) is not built.
"""
import torch
from torch import nn

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
        self.num_heads = _split(total_heads, self.kv_b_proj.tp_size, "num_attention_heads")
        # one head size for q / k / v in the cache and the op: the larger of K's and V's
        self.head_size = max(self.qk_dim, self.v_dim)
        theta, scaling = get_rope_config(hf_config)
        # V2 (HF: complex products, always) and V3 with rope_interleave (its default) rotate
        # interleaved pairs; V3 without it, each head's halves
        interleaved = getattr(hf_config, "model_type", "") != "deepseek_v3" or bool(
            getattr(hf_config, "rope_interleave", True))
        rotary_cls = InterleavedRotaryEmbedding if interleaved else RotaryEmbedding
        self.rotary_emb = rotary_cls(self.rope, max_positions_of(hf_config), theta, scaling,
                                     get_current_kiln_config().model_config.max_model_len)
        scale = self.qk_dim ** -0.5 * yarn_softmax_mscale(scaling)
        self.attn = Attention(self.num_heads, self.head_size, scale, self.num_heads,
                              prefix=f"{prefix}.attn")

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_heads_proj(x)

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """[T, nh, d] -> [T, nh * head_size], zeros after d (which change no score or sum)."""
        if t.shape[-1] < self.head_size:
            # cat, not F.pad: a traced pad read the token count as a constant (mode 3)
            zeros = t.new_zeros(t.shape[0], self.num_heads, self.head_size - t.shape[-1])
            t = torch.cat((t, zeros), dim=-1)
        return t.reshape(t.shape[0], self.num_heads * self.head_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens, nh = x.shape[0], self.num_heads
        q = self._queries(x).view(num_tokens, nh, self.qk_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, kv_lora_rank]
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.nope:].reshape(num_tokens, nh * self.rope),
                                     k_pe.contiguous())  # [T, nh * rope], [T, rope]: one head
        kv = self.kv_b_proj(latent).view(num_tokens, nh, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q[..., :self.nope], q_pe.view(num_tokens, nh, self.rope)), dim=-1)
        k = torch.cat((k_nope, k_pe.view(num_tokens, 1, self.rope).expand(num_tokens, nh,
                                                                            self.rope)), dim=-1)
        out = self.attn(self._pad(q), self._pad(k), self._pad(v))  # [T, nh * head_size]
        out = out.view(num_tokens, nh, self.head_size)[..., :self.v_dim]
        return self.o_proj(out.reshape(num_tokens, nh * self.v_dim))
