"""Registry from a checkpoint's `architectures` entry to Kiln's model class.

Classes are imported on lookup, so reading the registry stays cheap.
"""
import importlib

from kiln.errors import ConfigError

_MODELS = {
    "GemmaForCausalLM": ("kiln.model.gemma", "GemmaForCausalLM"),
    "GraniteForCausalLM": ("kiln.model.granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("kiln.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kiln.model.llama", "LlamaForCausalLM"),
    "Olmo2ForCausalLM": ("kiln.model.olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("kiln.model.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("kiln.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kiln.model.qwen3", "Qwen3ForCausalLM"),
}


# IR ops only some families call, by architecture (what `kiln compile`'s report lists as used).
_F32_NORMS = ("rms_norm_f32_scale", "fused_add_rms_norm_f32_scale")
_FAMILY_OPS = {"GemmaForCausalLM": (*_F32_NORMS, "gelu_tanh_and_mul"),
               "Olmo2ForCausalLM": _F32_NORMS}
# The Llama ops those families' own replace, with the fusions the graph passes make of them
# (a Gemma report listed rms_norm, silu_and_mul and their int8 fusions, which it never calls).
_LLAMA_NORMS = ("rms_norm", "fused_add_rms_norm", "rms_norm_dynamic_int8_quant",
                "fused_add_rms_norm_dynamic_int8_quant")
_SILU = ("silu_and_mul", "silu_and_mul_dynamic_int8_quant", "int8_scaled_mm_panels_silu_quant")
_REPLACED_OPS = {"GemmaForCausalLM": (*_LLAMA_NORMS, *_SILU), "Olmo2ForCausalLM": _LLAMA_NORMS}


def ir_ops_not_called(architecture: str) -> set[str]:
    """The family-only IR ops (_FAMILY_OPS) that `architecture`'s model never calls, and the
    Llama ops its own replace (_REPLACED_OPS)."""
    every = {op for ops in _FAMILY_OPS.values() for op in ops}
    return (every - set(_FAMILY_OPS.get(architecture, ()))) | set(
        _REPLACED_OPS.get(architecture, ()))


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ConfigError(f"architecture {architecture} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
