"""Gemma-3 (text: Gemma3ForCausalLM, model_type gemma3_text): Gemma-2's blocks, pre/post norms,
GeGLU, scaled embeddings and query_pre_attn_scalar, plus a per-head (1 + w) RMSNorm on q and k
before rope (Qwen3's placement), no attention soft cap, a final logit soft cap only where the
config sets one, and each layer roped by its type: sliding layers with rope_local_base_freq
(10k, unscaled), global ones with rope_theta (1M, a linear scaling on the larger models), which
transformers 5 keeps as rope_parameters nested by layer type. HF's layer_types (every sixth
layer global: sliding_window_pattern) gives the windows as for Gemma-2.
"""
from kiln.compilation.decorator import support_torch_compile
from kiln.config.rope import get_rope_config
from kiln.model.gemma import GemmaStyleModel
from kiln.model.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM
from kiln.model.layers.layernorm import GemmaRMSNorm
from kiln.model.llama import layer_index
from kiln.model.qwen3 import Qwen3Attention


class Gemma3Attention(Gemma2Attention, Qwen3Attention):
    """Gemma-2's scale and (absent) soft cap; Qwen3's per-head q/k norms with Gemma's norm."""
    qk_norm_cls = GemmaRMSNorm

    def logits_soft_cap(self, hf_config) -> float | None:
        # HF's Gemma-3 attention never applies attn_logit_softcapping (the config keeps the
        # field; vLLM's passes no cap, llama.cpp's converter asserts it unset)
        return None

    def rope_config(self, hf_config, prefix: str) -> tuple[float, dict | None]:
        # the layer's kind, not its window: --disable-sliding-window keeps the local base
        return get_rope_config(hf_config, hf_config.layer_types[layer_index(prefix)])


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


@support_torch_compile
class Gemma3Model(GemmaStyleModel):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma-2's head: final_logit_softcapping applied where set (None in released configs)."""
    model_cls = Gemma3Model
