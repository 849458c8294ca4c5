"""Gemma-2: Gemma's (1 + w) norms, GeGLU and scaled embeddings, plus a norm after each block as
well as before (pre/post attention, pre/post feed-forward), softmax scale query_pre_attn_scalar
** -0.5, attention scores and final logits soft-capped (cap * tanh(x / cap)), and sliding-window
layers alternating with global ones (HF's layer_types: even layers slide).

HF: h = h + post_attention_layernorm(attn(input_layernorm(h)));
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
The layer is sandwich_norm.py's: the pre-feed-forward norm's fused add takes the attention
branch into the residual.
The attention soft cap is the attention backends' (a parameter of each layer's impl), so it
stays inside the opaque attention op under compile.
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.gemma import GemmaAttention, GemmaMLP, GemmaStyleModel
from kiln.model.layers.layernorm import GemmaRMSNorm
from kiln.model.llama import LlamaStyleForCausalLM
from kiln.model.sandwich_norm import SandwichNormDecoderLayer


class Gemma2MLP(GemmaMLP):
    act_field = "hidden_activation"


class Gemma2Attention(GemmaAttention):
    def softmax_scale(self, hf_config) -> float:
        return hf_config.query_pre_attn_scalar ** -0.5

    def logits_soft_cap(self, hf_config) -> float | None:
        return getattr(hf_config, "attn_logit_softcapping", None) or None


class Gemma2DecoderLayer(SandwichNormDecoderLayer):
    attention_cls = Gemma2Attention
    mlp_cls = Gemma2MLP
    norm_cls = GemmaRMSNorm
    attn_out_norm = "post_attention_layernorm"
    mlp_in_norm = "pre_feedforward_layernorm"
    mlp_out_norm = "post_feedforward_layernorm"


@support_torch_compile
class Gemma2Model(GemmaStyleModel):
    layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, V] float32
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap
