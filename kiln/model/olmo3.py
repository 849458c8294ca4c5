"""OLMo-3: OLMo-2's layers (post-block norms, q / k norms over the whole projection) with
sliding-window layers by layer_types (three local to one global) and rope_parameters nested by
layer type (the long-context checkpoints' yarn on the global layers)."""
from kiln.compilation.decorator import support_torch_compile
from kiln.config.rope import get_rope_config
from kiln.model.llama import LlamaStyleForCausalLM, LlamaStyleModel, layer_index
from kiln.model.olmo2 import Olmo2Attention, Olmo2DecoderLayer


class Olmo3Attention(Olmo2Attention):
    def rope_config(self, hf_config, prefix: str) -> tuple[float, dict | None]:
        # the layer's kind, not its window: --disable-sliding-window keeps its rope
        return get_rope_config(hf_config, hf_config.layer_types[layer_index(prefix)])


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    attention_cls = Olmo3Attention


@support_torch_compile
class Olmo3Model(LlamaStyleModel):
    layer_cls = Olmo3DecoderLayer


class Olmo3ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Olmo3Model
