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


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ConfigError(f"architecture {architecture} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
