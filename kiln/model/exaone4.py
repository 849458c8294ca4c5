"""EXAONE-4: OLMo-2's post-block norms (Llama's RMSNorm, not float32-scaled) with Qwen3's
per-head q / k norms, sliding layers by layer_types (three local to one global in the 32B) and
the global layers NoPE (nope.py) where the config has a window; no biases.
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.llama import LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.nope import NoPEAttentionMixin
from kiln.model.olmo2 import Olmo2DecoderLayer
from kiln.model.qwen3 import Qwen3Attention


class Exaone4Attention(NoPEAttentionMixin, Qwen3Attention):
    pass


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_cls = Exaone4Attention
    norm_cls = RMSNorm


@support_torch_compile
class Exaone4Model(LlamaStyleModel):
    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Exaone4Model
