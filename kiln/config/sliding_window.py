"""A checkpoint's sliding-window attention: the window, and which layers it limits, as each HF
model class reads them (Mixtral, Phi-3, Qwen3-MoE, StarCoder2: every layer; Mistral, Qwen2/3,
Qwen2-MoE, Gemma-2, Gemma-3, OLMo-3, SmolLM3, EXAONE-4: those `layer_types` names
`sliding_attention`, else every layer;
the others: none)."""
from kiln.errors import ConfigError
from kiln.model.registry import causal_architecture

LAYER_TYPES = ("full_attention", "sliding_attention")

# HF's attention of these classes takes `sliding_window` in every layer (layer_types unread).
_EVERY_LAYER = ("MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM",
                "Starcoder2ForCausalLM")
# These window the layers their config's layer_types names (resolved from use_sliding_window
# and max_window_layers by transformers' Qwen configs, alternating in Gemma-2's, every sixth
# layer global in Gemma-3's, every fourth in OLMo-3's and EXAONE-4's; SmolLM3's gated by
# use_sliding_window as Qwen's; a Mistral
# config with layer_types is read by AutoConfig as Ministral's, which honours them).
_BY_LAYER_TYPES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Qwen2MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                   "Olmo3ForCausalLM", "SmolLM3ForCausalLM", "Exaone4ForCausalLM")
# Every other family (Llama, Granite, Gemma, OLMo-2, GPT-NeoX, Phi, Cohere, GLM-4, Seed-OSS,
# ERNIE-4.5) attends fully
# whatever its config says: HF's model classes never read a stray `sliding_window`.


def _family(architecture: str) -> str:
    """A *ForSequenceClassification's backbone family: its *ForCausalLM name."""
    return causal_architecture(architecture)


def sliding_window_of(hf_config, architecture: str) -> int | None:
    """The attention window some layer of `architecture` (the config's HF model class) limits
    to (None: every layer full).

    Qwen2/3 gate the window with `use_sliding_window` (transformers drops it when false) and
    name the windowed layers in `layer_types`."""
    family = _family(architecture)
    if family not in _EVERY_LAYER and family not in _BY_LAYER_TYPES:
        return None
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if (family in _BY_LAYER_TYPES and layer_types is not None
            and "sliding_attention" not in layer_types):
        return None
    return int(window)


def layer_sliding_windows(hf_config, architecture: str) -> list[int | None]:
    """Each decoder layer's window (None: full attention), as HF's attention layers take it."""
    num_layers = getattr(hf_config, "num_hidden_layers", 0)
    window = sliding_window_of(hf_config, architecture)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None or _family(architecture) in _EVERY_LAYER:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types names {len(layer_types)} layers, num_hidden_layers is "
                          f"{num_layers}: fix the checkpoint's config.json")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {', '.join(map(repr, unknown))} are not supported; "
                          f"Kiln's attention layers are {' or '.join(LAYER_TYPES)}")
    return [window if kind == "sliding_attention" else None for kind in layer_types]
