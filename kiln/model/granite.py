"""Granite (IBM Granite 3.x dense): the Llama layout with four scalar multipliers.

- embedding_multiplier: the token embeddings are scaled by it;
- residual_multiplier: each attention / MLP output is scaled by it before the residual add
  (HF: residual + out * m; here out * m is what the next fused add-RMSNorm adds, the same sum);
- attention_multiplier: the softmax scale, in place of head_dim ** -0.5;
- logits_scaling: the logits are divided by it.
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class GraniteAttention(LlamaAttention):
    def softmax_scale(self, hf_config) -> float:
        return float(hf_config.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.residual_multiplier = float(hf_config.residual_multiplier)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


@support_torch_compile
class GraniteModel(LlamaStyleModel):
    layer_cls = GraniteDecoderLayer

    def __init__(self, *, kiln_config, prefix: str = "model"):
        super().__init__(kiln_config=kiln_config, prefix=prefix)
        self.embedding_multiplier = float(
            kiln_config.model_config.hf_config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaStyleForCausalLM):
    model_cls = GraniteModel

    def __init__(self, *, kiln_config, prefix: str = ""):
        super().__init__(kiln_config=kiln_config, prefix=prefix)
        self.logits_scaling = float(self.config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling  # [N, V] float32
