"""OLMo-2: norms after each block instead of before, and RMSNorm on q and k over the whole
projection (all heads at once, not per head as Qwen3's).

HF: h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h)).
Here a layer takes (hidden, residual) whose sum is h, as the Llama layers pass it, and returns
(mlp branch, h after attention): the next layer (or the final norm's fused add) adds them, the
same sum HF takes. Every norm scales in float32 before rounding (Olmo2RMSNorm), the IR op
rms_norm_f32_scale. The q / k norms span every head, so they would need all of a projection
across tensor-parallel ranks: tensor_parallel_size > 1 is refused.
"""
import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.layers.layernorm import F32ScaleRMSNorm
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class Olmo2Attention(LlamaAttention):
    family = "Olmo2ForCausalLM"  # named in the tensor-parallel refusal

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self._check_tp(self.qkv_proj.tp_size)
        eps = hf_config.rms_norm_eps
        self.q_norm = F32ScaleRMSNorm(self.q_size, eps)
        self.k_norm = F32ScaleRMSNorm(self.kv_size, eps)

    @classmethod
    def _check_tp(cls, tp_size: int) -> None:
        if tp_size > 1:
            raise ConfigError(f"{cls.family} runs with tensor_parallel_size 1 only: its q / k "
                              "norms span every head of the projection, which a rank holds a "
                              "share of; use pipeline parallelism (-pp) to split it")

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
