"""Llama's attention with rope over the first `partial_rotary_factor` of each head (GPT-NeoX's
rotary_pct, Phi's partial_rotary_factor, GLM-4's interleaved), the rest of each head passed
through unroped."""
from kiln.config import get_current_kiln_config
from kiln.config.rope import get_rope_config, partial_rotary_factor_of, rope_positions
from kiln.errors import ConfigError
from kiln.model.layers.rotary_embedding import PartialRotaryEmbedding
from kiln.model.llama import LlamaAttention, head_dim_of


class PartialRotaryAttention(LlamaAttention):
    partial_rotary_cls = PartialRotaryEmbedding  # GLM-4's: over interleaved pairs

    def __init__(self, hf_config, prefix: str):
        factor, head_dim = partial_rotary_factor_of(hf_config), head_dim_of(hf_config)
        rotary_dim = int(head_dim * factor)  # HF's rotary_ndims
        if rotary_dim < 2 or rotary_dim % 2:
            raise ConfigError(f"rotary_pct / partial_rotary_factor {factor} gives {rotary_dim} "
                              f"rotary dims of head_dim {head_dim}; Kiln needs an even "
                              "number of at least 2")
        super().__init__(hf_config, prefix)
        if rotary_dim < self.head_dim:
            theta, scaling = get_rope_config(hf_config)
            max_model_len = get_current_kiln_config().model_config.max_model_len
            self.rotary_emb = self.partial_rotary_cls(
                self.head_dim, rotary_dim, rope_positions(hf_config, max_model_len), theta,
                scaling, max_model_len)
