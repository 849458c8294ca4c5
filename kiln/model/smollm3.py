"""SmolLM3: the Llama layout with rope left out of some layers (no_rope_layers: every fourth
layer NoPE in the released 3B) and Qwen2-style windows by layer_types when use_sliding_window
(off in released configs)."""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.nope import NoPEAttentionMixin


class SmolLM3Attention(NoPEAttentionMixin, LlamaAttention):
    pass


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_cls = SmolLM3Attention


@support_torch_compile
class SmolLM3Model(LlamaStyleModel):
    layer_cls = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaStyleForCausalLM):
    model_cls = SmolLM3Model
