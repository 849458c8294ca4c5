"""GLM-4 (Glm4ForCausalLM: the GLM-4-0414 / GLM-Z1 checkpoints): a norm after each block as well
as before, rope over interleaved pairs of the first half of each head (partial_rotary_factor),
biases on q / k / v only, and the gate / up projections fused in the checkpoint (split on load as
Phi-3's).

HF: h = h + post_self_attn_layernorm(attn(input_layernorm(h)));
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h))): Gemma-2's layer
(sandwich_norm.py) under other names.
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.rotary_embedding import (
    InterleavedPartialRotaryEmbedding,
    InterleavedRotaryEmbedding,
)
from kiln.model.llama import LlamaStyleModel
from kiln.model.partial_rotary import PartialRotaryAttention
from kiln.model.phi3 import Phi3ForCausalLM
from kiln.model.sandwich_norm import SandwichNormDecoderLayer


class Glm4Attention(PartialRotaryAttention):
    rotary_cls = InterleavedRotaryEmbedding  # a factor of 1: the whole head
    partial_rotary_cls = InterleavedPartialRotaryEmbedding

    def o_proj_bias(self, hf_config) -> bool:
        return False  # HF's o_proj has none whatever attention_bias says


class Glm4DecoderLayer(SandwichNormDecoderLayer):
    attention_cls = Glm4Attention
    attn_out_norm = "post_self_attn_layernorm"
    mlp_in_norm = "post_attention_layernorm"
    mlp_out_norm = "post_mlp_layernorm"


@support_torch_compile
class Glm4Model(LlamaStyleModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(Phi3ForCausalLM):
    """Phi-3's load: the checkpoint's gate_up_proj split into gate / up before sharding."""
    model_cls = Glm4Model
    fused_checkpoint_modules = ("gate_up_proj",)
