"""A model's rope settings, from transformers' `rope_parameters` (5.x) or rope_theta /
rope_scaling, and the positions they let it serve (a linear scaling stretches them)."""
import math
import numbers

from kiln.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The numbers each type's formula divides by (kiln/model/layers/rotary_embedding.py).
_POSITIVE_FIELDS = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings")}


def _positive(value) -> bool:
    """A finite number > 0 (not a bool, not a string)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < value < math.inf


def _check_numbers(scaling: dict) -> None:
    """transformers only warns about a factor that is not a number >= 1 and loads the config:
    "abc" then failed as 'could not convert string to float', and -2 (or 0) as a traceback
    building a rotary cache of negative length, neither naming the field."""
    for name in _POSITIVE_FIELDS.get(scaling["rope_type"], ()):
        value = scaling.get(name)
        if not _positive(value):
            raise ConfigError(f"rope_scaling {name} must be a finite number > 0 for rope_type "
                              f"{scaling['rope_type']!r}, got {value!r}")


def get_rope_config(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a transformers config of any recent version."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        # transformers 5's per-layer-type form: read as one flat dict it gave theta 10000 and
        # no scaling, silently (HF's Llama/Qwen classes cannot run it either).
        raise ConfigError(f"rope_parameters nested by layer type ({', '.join(map(str, params))})"
                          " are not supported; give one flat rope_parameters (rope_type, "
                          "rope_theta, ...) for every layer")
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
        _check_numbers(scaling)
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def max_positions_of(hf_config) -> int:
    """Positions the model serves: max_position_embeddings (2048 where unset), times a linear
    rope scaling's factor, which divides positions (vicuna-7b-v1.5-16k: 4096 x 4), as vLLM
    derives its length; HF computes rotary angles for any position."""
    trained = getattr(hf_config, "max_position_embeddings", None)
    if trained is None:
        trained = 2048
    if isinstance(trained, float) and trained.is_integer():
        trained = int(trained)
    if isinstance(trained, bool) or not isinstance(trained, int) or trained < 1:
        # -5 failed as a traceback building a rotary cache of negative length, 0 was read as
        # unset (2048)
        raise ConfigError(f"max_position_embeddings must be an integer >= 1, got {trained!r}")
    _, scaling = get_rope_config(hf_config)
    if scaling is None or scaling["rope_type"] != "linear":
        return trained
    return int(trained * float(scaling["factor"]))
