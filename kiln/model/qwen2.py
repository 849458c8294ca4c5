"""Qwen2: the Llama layout with biases on the q/k/v projections (none on o_proj).

Reuses the Llama blocks; only the attention's bias choice differs.
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, hf_config) -> bool:
        return True

    def o_proj_bias(self, hf_config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


@support_torch_compile
class Qwen2Model(LlamaStyleModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Qwen2Model
