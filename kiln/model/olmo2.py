"""OLMo-2: norms after each block instead of before, and RMSNorm on q and k over the whole
projection (all heads at once, not per head as Qwen3's).

HF: h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h)).
Here a layer takes (hidden, residual) whose sum is h, as the Llama layers pass it, and returns
(mlp branch, h after attention): the next layer (or the final norm's fused add) adds them, the
same sum HF takes. Every norm scales in float32 before rounding (Olmo2RMSNorm), the IR op
rms_norm_f32_scale. The q / k norms span every head: under tensor parallelism the ranks sum
their shares' mean squares (sharded_rms_norm.py).
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.layernorm import F32ScaleRMSNorm
from kiln.model.layers.sharded_rms_norm import whole_projection_norms
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class Olmo2Attention(LlamaAttention):
    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.q_norm, self.k_norm = whole_projection_norms(self.qkv_proj, hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)  # [T, nh*hd], [T, nkv*hd]: whole rows
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention
    norm_cls = F32ScaleRMSNorm

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        del self.input_layernorm  # OLMo-2 normalises block outputs, not inputs
        self.post_feedforward_layernorm = self.norm_cls(hf_config.hidden_size,
                                                        hf_config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is not None:
            hidden = hidden + residual  # h: the previous layer's MLP branch added
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


@support_torch_compile
class Olmo2Model(LlamaStyleModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Olmo2Model
