"""A checkpoint's sliding-window attention: the window, and which layers it limits (Mistral and
Phi-3: every layer; Qwen2/3 and Gemma-2: those HF's `layer_types` names `sliding_attention`)."""
from kiln.errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window_of(hf_config) -> int | None:
    """The attention window some layer of this config limits to (None: every layer full).

    Mistral sets `sliding_window` alone; Qwen2/3 gate it with `use_sliding_window` and name the
    windowed layers in `layer_types` (transformers 5)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def layer_sliding_windows(hf_config) -> list[int | None]:
    """Each decoder layer's window (None: full attention), as HF's attention layers take it."""
    num_layers = getattr(hf_config, "num_hidden_layers", 0)
    window = sliding_window_of(hf_config)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types names {len(layer_types)} layers, num_hidden_layers is "
                          f"{num_layers}: fix the checkpoint's config.json")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {', '.join(map(repr, unknown))} are not supported; "
                          f"Kiln's attention layers are {' or '.join(LAYER_TYPES)}")
    return [window if kind == "sliding_attention" else None for kind in layer_types]
