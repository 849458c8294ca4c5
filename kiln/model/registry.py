"""Registry from a checkpoint's `architectures` entry to Kiln's model class.

Classes are imported on lookup, so reading the registry stays cheap.
"""
import importlib

from kiln.errors import ConfigError

_MODELS = {
    "CohereForCausalLM": ("kiln.model.cohere", "CohereForCausalLM"),
    "DeepseekV2ForCausalLM": ("kiln.model.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kiln.model.deepseek_v2", "DeepseekV3ForCausalLM"),
    "Ernie4_5ForCausalLM": ("kiln.model.ernie4_5", "Ernie4_5ForCausalLM"),
    "Exaone4ForCausalLM": ("kiln.model.exaone4", "Exaone4ForCausalLM"),
    "GemmaForCausalLM": ("kiln.model.gemma", "GemmaForCausalLM"),
    "Glm4ForCausalLM": ("kiln.model.glm4", "Glm4ForCausalLM"),
    "Gemma2ForCausalLM": ("kiln.model.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("kiln.model.gemma3", "Gemma3ForCausalLM"),
    "GPTNeoXForCausalLM": ("kiln.model.gpt_neox", "GPTNeoXForCausalLM"),
    "GraniteForCausalLM": ("kiln.model.granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("kiln.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kiln.model.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("kiln.model.mixtral", "MixtralForCausalLM"),
    "Olmo2ForCausalLM": ("kiln.model.olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("kiln.model.olmo3", "Olmo3ForCausalLM"),
    "PhiForCausalLM": ("kiln.model.phi", "PhiForCausalLM"),
    "Phi3ForCausalLM": ("kiln.model.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("kiln.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("kiln.model.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("kiln.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("kiln.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    "SeedOssForCausalLM": ("kiln.model.seed_oss", "SeedOssForCausalLM"),
    "SmolLM3ForCausalLM": ("kiln.model.smollm3", "SmolLM3ForCausalLM"),
    "Starcoder2ForCausalLM": ("kiln.model.starcoder2", "Starcoder2ForCausalLM"),
}
# Draft heads, built only as a --speculative-config head (never served as --model)
_DRAFT_HEADS = {"EagleLlamaForCausalLM": ("kiln.model.llama_eagle", "EagleLlamaForCausalLM"),
                "Eagle3LlamaForCausalLM": ("kiln.model.llama_eagle3", "Eagle3LlamaForCausalLM")}
# HF's *ForSequenceClassification: the family's backbone and a score head (seq_cls.py)
# (Gemma-3's text classifier is Gemma3Text*: Gemma3ForSequenceClassification is the vision
# model's; Granite, Cohere and ERNIE-4.5 have no HF classifier class)
_SEQ_CLS = {name.replace("ForCausalLM", "ForSequenceClassification"): name for name in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "GemmaForCausalLM", "Gemma2ForCausalLM", "GPTNeoXForCausalLM", "Starcoder2ForCausalLM",
    "PhiForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM",
    "Exaone4ForCausalLM", "SeedOssForCausalLM", "Glm4ForCausalLM")}
_SEQ_CLS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"


# IR ops only some families call, by architecture (what `kiln compile`'s report lists as used).
# Gemma / Gemma-2 / OLMo-2 / OLMo-3's norms (kiln/ir/f32_scale_norm.py)
F32_SCALE_NORM_OPS = ("rms_norm_f32_scale", "fused_add_rms_norm_f32_scale")
# StarCoder2 / GPT-NeoX / Phi's LayerNorms and non-gated GELU MLPs (kiln/ir/layer_norm.py,
# layer_ops.py)
LAYER_NORM_GELU_OPS = ("layer_norm", "fused_add_layer_norm", "gelu")
# Families whose projections are none of LoRA's targets (kiln/lora/adapter.py: Llama's
# q/k/v/o, gate/up/down, Phi's q/k/v, dense, fc1 / fc2): a non-gated c_fc / c_proj MLP under
# other names. --enable-lora is refused for them by name.
NO_LORA_ARCHITECTURES = ("Starcoder2ForCausalLM", "GPTNeoXForCausalLM")
# The mixture-of-experts families (kiln/model/layers/fused_moe.py).
# DeepSeek's Multi-head Latent Attention families (kiln/model/layers/mla.py): no quantization
# (nothing of theirs is checked quantized), no GGUF
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     *MLA_ARCHITECTURES)
_FAMILY_OPS = {"GemmaForCausalLM": (*F32_SCALE_NORM_OPS, "gelu_tanh_and_mul"),
               "Gemma2ForCausalLM": (*F32_SCALE_NORM_OPS, "gelu_tanh_and_mul"),
               "Gemma3ForCausalLM": (*F32_SCALE_NORM_OPS, "gelu_tanh_and_mul"),
               "Olmo2ForCausalLM": F32_SCALE_NORM_OPS, "Olmo3ForCausalLM": F32_SCALE_NORM_OPS,
               "Starcoder2ForCausalLM": LAYER_NORM_GELU_OPS,
               "GPTNeoXForCausalLM": LAYER_NORM_GELU_OPS,
               "PhiForCausalLM": LAYER_NORM_GELU_OPS,
               # Cohere's MLP is Llama's SiLU-gated one
               "CohereForCausalLM": ("layer_norm", "fused_add_layer_norm"),
               **{arch: ("fused_moe", "fused_moe_int8", "fused_moe_int8_panels")
                  for arch in MOE_ARCHITECTURES}}
# The Llama ops those families' own replace, with the fusions the graph passes make of them
# (a Gemma report listed rms_norm, silu_and_mul and their int8 fusions, which it never calls).
_LLAMA_NORMS = ("rms_norm", "fused_add_rms_norm", "rms_norm_dynamic_int8_quant",
                "fused_add_rms_norm_dynamic_int8_quant")
_SILU = ("silu_and_mul", "silu_and_mul_dynamic_int8_quant", "int8_scaled_mm_panels_silu_quant")
_REPLACED_OPS = {"GemmaForCausalLM": (*_LLAMA_NORMS, *_SILU),
                 "Gemma2ForCausalLM": (*_LLAMA_NORMS, *_SILU),
                 "Gemma3ForCausalLM": (*_LLAMA_NORMS, *_SILU), "Olmo2ForCausalLM": _LLAMA_NORMS,
                 "Olmo3ForCausalLM": _LLAMA_NORMS,
                 "Starcoder2ForCausalLM": (*_LLAMA_NORMS, *_SILU),
                 "GPTNeoXForCausalLM": (*_LLAMA_NORMS, *_SILU),
                 "PhiForCausalLM": (*_LLAMA_NORMS, *_SILU), "CohereForCausalLM": _LLAMA_NORMS}


def causal_architecture(architecture: str) -> str:
    """The *ForCausalLM family a *ForSequenceClassification architecture runs (itself for any
    other): what the per-family tables (windows, LoRA, MoE, IR ops) are keyed by."""
    return _SEQ_CLS.get(architecture, architecture)


def ir_ops_not_called(architecture: str) -> set[str]:
    """The family-only IR ops (_FAMILY_OPS) that `architecture`'s model never calls, and the
    Llama ops its own replace (_REPLACED_OPS)."""
    every = {op for ops in _FAMILY_OPS.values() for op in ops}
    architecture = causal_architecture(architecture)
    return (every - set(_FAMILY_OPS.get(architecture, ()))) | set(
        _REPLACED_OPS.get(architecture, ()))


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_SEQ_CLS])


# What to say of a well-known architecture Kiln does not serve, beside the list.
_EAGLE_HEAD = ("an EAGLE draft head, not a model: pass it as --speculative-config "
               "'{\"method\": \"eagle\", \"model\": ..., \"num_speculative_tokens\": 3}' "
               "beside its target model")
_NEAREST = {"Gemma3ForConditionalGeneration": (
    "its vision tower is not (Kiln serves text); Gemma-3's text-only checkpoints "
    "(Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b) are"),
    "EagleLlamaForCausalLM": _EAGLE_HEAD, "EAGLELlamaForCausalLM": _EAGLE_HEAD,
    **dict.fromkeys(("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"),
                    _EAGLE_HEAD.replace('"eagle"', '"eagle3"'))}


def unsupported_message(architecture: str) -> str:
    hint = f" ({_NEAREST[architecture]})" if architecture in _NEAREST else ""
    return (f"architecture {architecture} is not supported{hint}; supported: "
            f"{', '.join(supported_architectures())}")


def get_model_class(architecture: str, classify: bool = False) -> type:
    """The class of `architecture`; `classify` (--convert classify): its family's with a
    score head in place of the LM head."""
    if architecture in _DRAFT_HEADS:
        return getattr(importlib.import_module(_DRAFT_HEADS[architecture][0]),
                       _DRAFT_HEADS[architecture][1])
    if architecture not in _MODELS and architecture not in _SEQ_CLS:
        raise ConfigError(unsupported_message(architecture))
    module, name = _MODELS[_SEQ_CLS.get(architecture, architecture)]
    model_cls = getattr(importlib.import_module(module), name)
    if classify or architecture in _SEQ_CLS:
        from kiln.model.seq_cls import for_sequence_classification
        return for_sequence_classification(model_cls)
    return model_cls
