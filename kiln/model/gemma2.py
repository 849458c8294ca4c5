"""Gemma-2: Gemma's (1 + w) norms, GeGLU and scaled embeddings, plus a norm after each block as
well as before (pre/post attention, pre/post feed-forward), softmax scale query_pre_attn_scalar
** -0.5, attention scores and final logits soft-capped (cap * tanh(x / cap)), and sliding-window
layers alternating with global ones (HF's layer_types: even layers slide).

HF: h = h + post_attention_layernorm(attn(input_layernorm(h)));
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
Here a layer takes (hidden, residual) whose sum is h, as the Llama layers pass it: the
pre-feed-forward norm's fused add takes the attention branch into the residual, and the layer
returns (the feed-forward branch, h after attention) for the next layer's input norm to add.
The attention soft cap is the attention backends' (a parameter of each layer's impl), so it
stays inside the opaque attention op under compile.
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.gemma import GemmaAttention, GemmaMLP, GemmaStyleModel
from kiln.model.layers.layernorm import GemmaRMSNorm
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleForCausalLM


class Gemma2MLP(GemmaMLP):
    act_field = "hidden_activation"


class Gemma2Attention(GemmaAttention):
    def softmax_scale(self, hf_config) -> float:
        return hf_config.query_pre_attn_scalar ** -0.5

    def logits_soft_cap(self, hf_config) -> float | None:
        return getattr(hf_config, "attn_logit_softcapping", None) or None


class Gemma2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma2Attention
    mlp_cls = Gemma2MLP
    norm_cls = GemmaRMSNorm

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.pre_feedforward_layernorm = self.norm_cls(hidden, eps)
        self.post_feedforward_layernorm = self.norm_cls(hidden, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


@support_torch_compile
class Gemma2Model(GemmaStyleModel):
    layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, V] float32
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap
