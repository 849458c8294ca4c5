"""ERNIE-4.5 dense (Ernie4_5ForCausalLM: ERNIE-4.5-0.3B): the Llama layout with rope over each
head's interleaved pairs (HF's GLM-style rotate_half) and one use_bias switching every linear's
bias (checkpoint_names.config_bias), the head tied in the released checkpoint."""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.rotary_embedding import InterleavedRotaryEmbedding
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class Ernie4_5Attention(LlamaAttention):
    rotary_cls = InterleavedRotaryEmbedding


class Ernie4_5DecoderLayer(LlamaDecoderLayer):
    attention_cls = Ernie4_5Attention


@support_torch_compile
class Ernie4_5Model(LlamaStyleModel):
    layer_cls = Ernie4_5DecoderLayer


class Ernie4_5ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Ernie4_5Model
