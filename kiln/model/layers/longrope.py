"""LongRoPE (Phi-3's 128k configs): which of the short / long per-frequency factors a model runs
with, and the attention factor HF multiplies cos and sin by.

HF switches per forward pass (long once a sequence outgrows original_max_position_embeddings,
its generate() then recomputing the whole cache). A paged cache cannot re-rotate the keys it
holds, so, as vLLM does, the engine's max_model_len decides once: the long factors where a
sequence may outgrow the original length, else the short ones (decided again before warm-up
where the KV cache capped an unset max_model_len: fit_rotary_to_max_model_len). Either way
sequences HF runs with the same factors (any that fits a short engine; one whose prompt is
longer than the original length in a long one) match HF exactly; a short prompt in a long
engine runs the long factors.
"""
import math

from kiln.errors import ConfigError


def uses_long_factors(scaling: dict, max_model_len: int | None) -> bool:
    """True where `max_model_len` passes the original length (rope.py fills it in)."""
    if max_model_len is None:
        raise ConfigError("rope_scaling type 'longrope' needs the engine's max_model_len to "
                          "choose between short_factor and long_factor")
    return max_model_len > int(scaling["original_max_position_embeddings"])


def longrope_factors(scaling: dict, rotary_dim: int, max_model_len: int | None) -> list[float]:
    """The factor list the frequencies are divided by, [rotary_dim // 2]."""
    name = "long_factor" if uses_long_factors(scaling, max_model_len) else "short_factor"
    factors = [float(f) for f in scaling[name]]
    if len(factors) != rotary_dim // 2:
        raise ConfigError(f"rope_scaling {name} has {len(factors)} values, but the rotary "
                          f"embedding has {rotary_dim // 2} frequencies (head_dim {rotary_dim} "
                          "/ 2); the config's rope_scaling does not match its head size")
    return factors


def longrope_mscale(scaling: dict) -> float:
    """HF's attention factor: the config's attention_factor, else sqrt(1 + ln(factor) /
    ln(original length)) for a factor above 1 (rope.py sets factor to max_position_embeddings
    over the original length where the config has none), else 1. Other types: 1."""
    if scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_variant(hf_config, max_model_len: int | None) -> str | None:
    """"long" or "short": the factors a longrope model's rotary cache holds, for keys of what
    is kept of a loaded model (weight_snapshot.py); None for any other rope. Rope nested by
    layer type (Gemma-3) answers for each type that is longrope."""
    from kiln.config.rope import get_rope_config, rope_nested

    kinds = list(hf_config.rope_parameters) if rope_nested(hf_config) else [None]
    variants = []
    for kind in kinds:
        _, scaling = get_rope_config(hf_config, kind)
        if scaling is not None and scaling["rope_type"] == "longrope":
            variants.append("long" if uses_long_factors(scaling, max_model_len) else "short")
    return "+".join(variants) or None
