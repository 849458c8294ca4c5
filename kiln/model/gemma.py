"""Gemma (1): the Llama layout with Gemma's RMSNorm (scaled by 1 + weight, in float32), a GeGLU
MLP (gelu_pytorch_tanh gate) and token embeddings scaled by sqrt(hidden_size) rounded to the
model dtype first, as HF's GemmaTextScaledWordEmbedding does (55.4256 becomes 55.5 in bfloat16).

head_dim comes from the config (256 in the released 7B, where 16 heads x 256 != 3072 hidden);
the head is tied to the embedding unless the config says otherwise.
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.layers.activation import GeluTanhAndMul
from kiln.model.layers.layernorm import GemmaRMSNorm
from kiln.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaStyleForCausalLM,
    LlamaStyleModel,
)


class GemmaMLP(LlamaMLP):
    # HF's GemmaConfig turns the legacy "gelu" of the released configs into the tanh form
    activations = {"gelu_pytorch_tanh": GeluTanhAndMul, "gelu": GeluTanhAndMul}


class GemmaAttention(LlamaAttention):
    def __init__(self, hf_config, prefix: str):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ConfigError("use_bidirectional_attention true is not supported: Kiln's "
                              "attention is causal (a decoder for generation)")
        super().__init__(hf_config, prefix)


class GemmaDecoderLayer(LlamaDecoderLayer):
    attention_cls = GemmaAttention
    mlp_cls = GemmaMLP
    norm_cls = GemmaRMSNorm


class GemmaStyleModel(LlamaStyleModel):
    """The undecorated backbone with Gemma's scaled embeddings (Gemma-2's reuses it)."""

    def __init__(self, *, kiln_config, prefix: str = "model"):
        super().__init__(kiln_config=kiln_config, prefix=prefix)
        hidden = kiln_config.model_config.hf_config.hidden_size
        self.register_buffer("normalizer", torch.tensor(hidden ** 0.5, dtype=torch.float32),
                             persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        return hidden * self.normalizer.to(hidden.dtype)


@support_torch_compile
class GemmaModel(GemmaStyleModel):
    layer_cls = GemmaDecoderLayer


class GemmaForCausalLM(LlamaStyleForCausalLM):
    model_cls = GemmaModel
