"""Qwen2-MoE: Qwen2's attention (q/k/v biases by `qkv_bias`) over sparse MoE blocks with a
sigmoid-gated shared expert (kiln/model/qwen_moe.py; some layers dense by the config).
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.qwen2 import Qwen2Attention
from kiln.model.qwen_moe import qwen_moe_mlp


class Qwen2MoeAttention(Qwen2Attention):
    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "qkv_bias", True))  # transformers 5's field; before, on


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention
    mlp_cls = staticmethod(qwen_moe_mlp)


@support_torch_compile
class Qwen2MoeModel(LlamaStyleModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaStyleForCausalLM):
    model_cls = Qwen2MoeModel
