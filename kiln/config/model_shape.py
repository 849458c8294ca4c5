"""A model's shape read off its HF config (hidden size, layers, heads, head size, MLA's latent):
`ModelShape`, ModelConfig's mixin for them, with vLLM's ModelConfig getters over the same."""
from kiln.config.sliding_window import layer_sliding_windows, sliding_window_of


class ModelShape:
    """ModelConfig's views of the model's dimensions (needs `hf_config`, `vocab_size`,
    `architecture` and `disable_sliding_window` from the config)."""

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        if self.is_mla:  # one latent "head" per token (kiln/attention/mla_backend.py)
            return 1
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads

    @property
    def is_mla(self) -> bool:
        """DeepSeek's latent attention (its config's head_dim is the rope part's)."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @property
    def use_mla(self) -> bool:
        """vLLM's name for is_mla."""
        return self.is_mla

    @property
    def kv_cache_parts(self) -> int:
        """Tensors a layer's cache holds per token: K and V, or the latent alone (MLA)."""
        return 1 if self.is_mla else 2

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        if self.is_mla:  # the cache row: the latent and the roped k_pe (as vLLM's)
            return self.hf_config.kv_lora_rank + self.hf_config.qk_rope_head_dim
        return getattr(self.hf_config, "head_dim", None) or self.hidden_size // self.num_heads

    # ---- vLLM's ModelConfig getters, read by scripts ported from vLLM ------------------------

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_head_size(self) -> int:
        return self.head_dim

    def get_total_num_kv_heads(self) -> int:
        return self.num_kv_heads

    def get_total_num_hidden_layers(self) -> int:
        return self.num_layers

    def get_sliding_window(self) -> int | None:
        """The model's attention window (vLLM's name); None without one or under
        --disable-sliding-window (the context is capped at it instead: max_model_len)."""
        if self.disable_sliding_window:
            return None
        return sliding_window_of(self.hf_config, self.architecture)

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """Decoder layer `layer_index`'s window (None: full attention)."""
        if self.disable_sliding_window:
            return None
        return layer_sliding_windows(self.hf_config, self.architecture)[layer_index]
