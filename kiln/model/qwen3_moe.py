"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) over sparse MoE blocks without a shared
expert (kiln/model/qwen_moe.py; routing weights renormalized where norm_topk_prob is set).
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.qwen3 import Qwen3Attention
from kiln.model.qwen_moe import qwen_moe_mlp


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    mlp_cls = staticmethod(qwen_moe_mlp)


@support_torch_compile
class Qwen3MoeModel(LlamaStyleModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaStyleForCausalLM):
    model_cls = Qwen3MoeModel
