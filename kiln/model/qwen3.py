"""Qwen3: the Llama layout plus a per-head RMSNorm on q and k before rotary embedding.

Biases follow `attention_bias` (off in released Qwen3 checkpoints).
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class Qwen3Attention(LlamaAttention):
    qk_norm_cls = RMSNorm  # Gemma-3's: its (1 + w) norm

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.q_norm = self.qk_norm_cls(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(self.head_dim, hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(x)
        num_tokens = x.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
                        ).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


@support_torch_compile
class Qwen3Model(LlamaStyleModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Qwen3Model
