"""A model's rope settings, from transformers' `rope_parameters` (5.x) or rope_theta /
rope_scaling, and the positions they let it serve (a linear scaling stretches them)."""
import math
import numbers

from kiln.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# The numbers each type's formula divides by (kiln/model/layers/rotary_embedding.py).
_POSITIVE_FIELDS = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings"),
                    "longrope": ("factor", "original_max_position_embeddings"),
                    "yarn": ("factor", "original_max_position_embeddings")}
# Fields a type may leave out, checked where given.
_OPTIONAL_POSITIVE_FIELDS = {"longrope": ("attention_factor",),
                             "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale",
                                      "mscale_all_dim")}
# Per-frequency factor lists (their length, head_dim / 2, is checked by the rotary embedding).
_FACTOR_LISTS = {"longrope": ("short_factor", "long_factor")}


def _positive(value) -> bool:
    """A finite number > 0 (not a bool, not a string)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < value < math.inf


def _check_numbers(scaling: dict) -> None:
    """transformers only warns about a factor that is not a number >= 1 and loads the config:
    "abc" then failed as 'could not convert string to float', and -2 (or 0) as a traceback
    building a rotary cache of negative length, neither naming the field."""
    rope_type = scaling["rope_type"]
    optional = _OPTIONAL_POSITIVE_FIELDS.get(rope_type, ())
    for name in _POSITIVE_FIELDS.get(rope_type, ()) + optional:
        value = scaling.get(name)
        if (value is not None or name not in optional) and not _positive(value):
            raise ConfigError(f"rope_scaling {name} must be a finite number > 0 for rope_type "
                              f"{rope_type!r}, got {value!r}")
    for name in _FACTOR_LISTS.get(rope_type, ()):
        value = scaling.get(name)
        if not isinstance(value, (list, tuple)) or not value or \
                not all(_positive(v) for v in value):
            raise ConfigError(f"rope_scaling {name} must be a list of finite numbers > 0 (one "
                              f"per rotary frequency, head_dim / 2) for rope_type "
                              f"{rope_type!r}, got {value!r}")


def _complete_longrope(scaling: dict, hf_config) -> None:
    """(yarn's too) HF's longrope reads original_max_position_embeddings from the config's top level where
    set (Phi-3's configs keep it there), and without a `factor` takes max_position_embeddings
    over it (which sets the attention factor): both put in the dict, so the rotary embedding
    needs nothing else of the config."""
    original = getattr(hf_config, "original_max_position_embeddings", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    original = scaling.get("original_max_position_embeddings")
    if scaling.get("factor") is None and _positive(original):
        longest = getattr(hf_config, "max_position_embeddings", None) or original
        scaling["factor"] = longest / original


def rope_nested(hf_config) -> bool:
    """Whether rope_parameters is transformers 5's per-layer-type form ({"full_attention":
    {...}, "sliding_attention": {...}}: Gemma-3's local and global bases)."""
    params = getattr(hf_config, "rope_parameters", None)
    return isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())


def get_rope_config(hf_config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a transformers config of any recent version;
    `layer_type` (a model that ropes each kind of layer its own way: Gemma-3) picks the entry
    of rope_parameters nested by layer type."""
    params = getattr(hf_config, "rope_parameters", None)
    if rope_nested(hf_config):
        if layer_type is None:
            # read as one flat dict it gave theta 10000 and no scaling, silently (HF's
            # Llama/Qwen classes cannot run it either)
            raise ConfigError(f"rope_parameters nested by layer type "
                              f"({', '.join(map(str, params))}) are not supported for "
                              f"{_architecture(hf_config)}; give one flat rope_parameters "
                              "(rope_type, rope_theta, ...) for every layer")
        if not isinstance(params.get(layer_type), dict):
            raise ConfigError(f"rope_parameters has no entry for the layer type {layer_type!r} "
                              f"(it has {', '.join(map(str, params))}); add one")
        params = params[layer_type]
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
        scaling = dict(scaling) if scaling else None
    if theta is None:
        theta = 10000.0
    if not _positive(theta):
        # 0 or below gives NaN frequencies: every logit NaN, served with a warning that blamed
        # float16 or the weights
        raise ConfigError(f"rope_theta must be a finite number > 0, got {theta!r}")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        scaling["rope_type"] = rope_type
        if rope_type in ("longrope", "yarn"):
            _complete_longrope(scaling, hf_config)
        if rope_type == "yarn" and scaling.get("original_max_position_embeddings") is None:
            # HF's: the config's top-level original length, else its max_position_embeddings
            scaling["original_max_position_embeddings"] = getattr(
                hf_config, "original_max_position_embeddings", None) or getattr(
                hf_config, "max_position_embeddings", None)
        _check_numbers(scaling)
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def partial_rotary_factor_of(hf_config) -> float:
    """The share of each head's dims the rope rotates: transformers 5 keeps it in
    rope_parameters (GPT-NeoX's rotary_pct is put there), older configs as a top-level
    partial_rotary_factor or GPT-NeoX's rotary_pct; 1.0 where none is set."""
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is None:
        factor = getattr(hf_config, "rotary_pct", None)
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        factor = params["partial_rotary_factor"]
    if factor is None:
        return 1.0
    if not _positive(factor) or factor > 1:
        raise ConfigError(f"partial_rotary_factor (rotary_pct) must be a number in (0, 1], got "
                          f"{factor!r}")
    return float(factor)


def _architecture(hf_config) -> str:
    return (getattr(hf_config, "architectures", None) or ["this architecture"])[0]


# The config keys vLLM reads a model's length from (_get_and_verify_max_len), smallest first
# wins: a checkpoint's config.json may carry a shorter max_seq_len / seq_length beside the
# base model's max_position_embeddings (Kiln read only the latter and served past it).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")


def _length_of(hf_config, key: str) -> int | None:
    value = getattr(hf_config, key, None)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        # -5 failed as a traceback building a rotary cache of negative length, 0 was read as
        # unset (2048)
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def trained_length_of(hf_config) -> tuple[str, int]:
    """(key, length) of the config's trained length as vLLM derives it: the smallest of
    _LENGTH_KEYS, model_max_length where set winning outright (vLLM's rule for Command-R),
    2048 where none is set (named max_position_embeddings, the key Kiln's models have)."""
    lengths = {key: n for key in _LENGTH_KEYS if (n := _length_of(hf_config, key)) is not None}
    if "model_max_length" in lengths:
        return "model_max_length", lengths["model_max_length"]
    if not lengths:
        return "max_position_embeddings", 2048
    return min(lengths.items(), key=lambda item: item[1])


def rope_positions(hf_config, max_model_len: int | None) -> int:
    """Positions a rotary cache holds: every one the model serves, and every one a longer
    --max-model-len reaches (KILN_ALLOW_LONG_MAX_MODEL_LEN; HF computes any position's angle)."""
    return max(max_positions_of(hf_config), max_model_len or 0)


def max_positions_of(hf_config) -> int:
    """Positions the model serves: its trained length (trained_length_of), times a linear
    rope scaling's factor, which divides positions (vicuna-7b-v1.5-16k: 4096 x 4), as vLLM
    derives its length; HF computes rotary angles for any position. Rope nested by layer type
    (Gemma-3) scales nothing: its max_position_embeddings (128k) already counts the global
    layers' linear factor, as vLLM reads Gemma-3's. A yarn scaling serves its
    original_max_position_embeddings x factor (vLLM's rule)."""
    _, trained = trained_length_of(hf_config)
    if rope_nested(hf_config):
        return trained
    _, scaling = get_rope_config(hf_config)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # vLLM's rule: the original length times the factor
        return int(float(scaling["original_max_position_embeddings"]) * float(scaling["factor"]))
    if scaling is None or scaling["rope_type"] != "linear":
        return trained
    return int(trained * float(scaling["factor"]))


def scaled_length_reason(hf_config, key: str, trained: int, limit: int) -> str:
    """Why max_positions_of gave `limit` past the trained length (`key`=`trained`): for the
    errors that name the model's limit."""
    _, scaling = get_rope_config(hf_config)
    if scaling is not None and scaling["rope_type"] == "yarn":
        return (f"original_max_position_embeddings="
                f"{int(float(scaling['original_max_position_embeddings']))} x yarn rope_scaling "
                f"factor {float(scaling['factor']):g} = {limit}")
    return f"{key}={trained} x linear rope_scaling factor {limit / trained:g} = {limit}"
