"""Which decoder layers rope q and k (NoPE: some layers attend with no position embedding):
SmolLM3's no_rope_layers, EXAONE-4's global layers beside sliding ones; and the attention mixin
that leaves a NoPE layer's q / k unroped."""
from kiln.errors import ConfigError
from kiln.model.layers.rotary_embedding import NoRotaryEmbedding
from kiln.model.llama import layer_index


def layer_uses_rope(hf_config, layer: int) -> bool:
    """Whether decoder layer `layer` ropes, as HF's class for the config decides.

    SmolLM3: no_rope_layers[layer] (1: rope; unset, every no_rope_layer_interval-th layer is
    NoPE). EXAONE-4: with a sliding_window set, only the sliding layers rope (the global ones
    are NoPE), whatever --disable-sliding-window makes of the windows; without one, every layer.
    """
    model_type = getattr(hf_config, "model_type", None)
    num_layers = hf_config.num_hidden_layers
    if model_type == "smollm3":
        flags = getattr(hf_config, "no_rope_layers", None)
        if flags is None:
            interval = getattr(hf_config, "no_rope_layer_interval", 4)
            return (layer + 1) % interval != 0
        if len(flags) != num_layers:
            raise ConfigError(f"no_rope_layers names {len(flags)} layers, num_hidden_layers is "
                              f"{num_layers}: fix the checkpoint's config.json")
        return bool(flags[layer])
    if model_type == "exaone4":
        if getattr(hf_config, "sliding_window", None) is None:
            return True
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is None or len(layer_types) != num_layers:
            raise ConfigError("EXAONE-4 with a sliding_window needs layer_types naming each of "
                              f"its {num_layers} layers (which decide the layers that rope); "
                              "fix the checkpoint's config.json")
        return layer_types[layer] == "sliding_attention"
    return True


class NoPEAttentionMixin:
    """Before a LlamaAttention subclass: its rotary embedding dropped on NoPE layers."""

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        if not layer_uses_rope(hf_config, layer_index(prefix)):
            self.rotary_emb = NoRotaryEmbedding()
