"""DeepSeek's Multi-head Latent Attention: queries (through a low-rank q_a / q_b pair where
q_lora_rank is set), one latent per token (kv_a_proj_with_mqa: kv_lora_rank dims, normed, and a
rope part shared by every head), expanded per head by kv_b_proj into K's nope part and V.

The paged cache holds only the latent and the roped k_pe per token (vLLM's MLA layout:
kiln/attention/mla_backend.py). The attention op takes the roped queries and the cache rows and
chooses per request, as vLLM: prefills expand the latent through kv_b_proj (multi-head
attention), decodes absorb kv_b_proj into the queries and the output (MQA over the latent).
"""
import torch
from torch import nn

from kiln import ir
from kiln.attention.mla_backend import LatentAttentionBackend, LatentAttentionImpl
from kiln.attention.mla_prefill import MLADims
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
    """The attention op over a latent cache: num_heads roped queries of nope + rope dims and
    each token's cache row (latent + rope), out [T, num_heads * v_dim]; the impl reads
    kv_b_proj's weight (kiln/attention/mla_backend.py)."""

    def __init__(self, dims: MLADims, scale: float, kv_b_proj: nn.Module, prefix: str):
        # set before Module.__init__ (which builds the impl): plain values, no submodule
        self.dims, self.kv_b_weight = dims, lambda: kv_b_proj.weight
        super().__init__(dims.num_heads, dims.latent + dims.rope, scale, 1, prefix)

    def _choose_backend(self):
        return LatentAttentionBackend

    def _new_impl(self):
        spec = get_current_kiln_config().speculative_config
        # a verify step (1 + k tokens) decodes absorbed, as vLLM's spec-as-decode MLA backends
        threshold = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
        return LatentAttentionImpl(self.dims, self.scale, self.kv_b_weight, threshold)

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads * self.dims.v_dim)  # [T, nh * v]
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
        # only its weight is read (by the attention impl, for both forms): no packed copy
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
        dims = MLADims(self.num_heads, self.nope, self.rope, self.kv_lora_rank, self.v_dim)
        self.attn = LatentAttention(dims, scale, self.kv_b_proj, prefix=f"{prefix}.attn")

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
        q = torch.cat((q[..., :self.nope], q_pe.view(num_tokens, nh, self.rope)), dim=-1)
        kv = torch.cat((latent, k_pe), dim=-1)  # [T, L + rope]: the cache row
        out = self.attn(q.reshape(num_tokens, -1), kv)  # [T, nh * v]
        return self.o_proj(out)
