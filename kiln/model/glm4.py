"""GLM-4 (Glm4ForCausalLM: the GLM-4-0414 / GLM-Z1 checkpoints): a norm after each block as well
as before, rope over interleaved pairs of the first half of each head (partial_rotary_factor),
biases on q / k / v only, and the gate / up projections fused in the checkpoint (split on load as
Phi-3's).

HF: h = h + post_self_attn_layernorm(attn(input_layernorm(h)));
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h))).
As Gemma-2's layer: the norm before the MLP adds the attention branch into the residual, and
the layer returns (the MLP branch, h after attention) for the next layer's input norm to add.
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.rotary_embedding import (
    InterleavedPartialRotaryEmbedding,
    InterleavedRotaryEmbedding,
)
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleModel
from kiln.model.partial_rotary import PartialRotaryAttention
from kiln.model.phi3 import Phi3ForCausalLM


class Glm4Attention(PartialRotaryAttention):
    rotary_cls = InterleavedRotaryEmbedding  # a factor of 1: the whole head
    partial_rotary_cls = InterleavedPartialRotaryEmbedding

    def o_proj_bias(self, hf_config) -> bool:
        return False  # HF's o_proj has none whatever attention_bias says


class Glm4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4Attention

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.post_self_attn_layernorm = self.norm_cls(hidden, eps)
        self.post_mlp_layernorm = self.norm_cls(hidden, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


@support_torch_compile
class Glm4Model(LlamaStyleModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(Phi3ForCausalLM):
    """Phi-3's load: the checkpoint's gate_up_proj split into gate / up before sharding."""
    model_cls = Glm4Model
    fused_checkpoint_modules = ("gate_up_proj",)
