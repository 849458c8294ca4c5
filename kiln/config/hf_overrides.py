"""vLLM's `--hf-overrides JSON` / `LLM(hf_overrides={...})`: changes to the model's Hugging Face
config, applied before the model is built. As vLLM's ModelConfig._apply_dict_overrides: a key
naming a sub-config (a nested config such as text_config) is merged into it, key by key and
recursively; any other key (a plain value, or a dict-valued parameter such as rope_scaling) is
set whole. The result is the config everything reads, so the compile cache key and the GGUF
weight snapshot key (both hash `hf_config.to_dict()`) follow the overrides."""
import json
import math
import numbers

from kiln.config.hf_config_snapshot import HFConfigSnapshot, snapshot_of
from kiln.errors import ConfigError

# The legacy rope fields transformers 5 folds into rope_parameters (what Kiln reads first;
# rope_local_base_freq: Gemma-3's sliding layers' base).
_LEGACY_ROPE = ("rope_scaling", "rope_theta", "rope_local_base_freq")

# Keys the models read as sizes, numbers or switches: transformers validates them in a
# config.json, nothing did in an override ("abc", 0, null or a list failed as a TypeError or
# ZeroDivisionError traceback in the engine core). Sizes marked True may be null (derived).
_SIZES = {"hidden_size": False, "intermediate_size": False, "num_hidden_layers": False,
          "num_attention_heads": False, "vocab_size": False, "num_key_value_heads": True,
          "head_dim": True}
_NUMBERS = ("rms_norm_eps", "embedding_multiplier", "residual_multiplier",
            "attention_multiplier", "logits_scaling")  # the last three: Granite's
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def parse_hf_overrides(text) -> dict | None:
    """--hf-overrides as vLLM takes it: a JSON object (a dict as given)."""
    if text is None or isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--hf-overrides must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object, got {type(value).__name__}")
    return value


def check_hf_overrides(overrides) -> None:
    if overrides is None:
        return
    if callable(overrides):
        raise ConfigError("hf_overrides as a function is vLLM's offline form; Kiln takes a dict "
                          "(its config crosses to the engine core's process): give the keys to "
                          "change, e.g. hf_overrides={'rope_theta': 1e6}")
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ConfigError(f"hf_overrides (--hf-overrides) must be a JSON object / dict with "
                          f"string keys, got {overrides!r}")
    try:  # it is hashed into cache keys and crosses to the core: plain JSON values only
        json.dumps(overrides, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hf_overrides (--hf-overrides) must hold JSON values: {e}") from None


def _value_refused(key: str, value) -> str | None:
    """What `key` must be, where the override's `value` is not that; None where it fits."""
    if key in _SIZES:
        if value is None and _SIZES[key]:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else "an integer >= 1" + (" or null" if _SIZES[key] else "")
    if key in _NUMBERS:
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value) and (value != 0 or key != "logits_scaling"))
        return None if ok else ("a finite number other than 0" if key == "logits_scaling"
                                else "a finite number")
    if key in _SWITCHES:
        return None if isinstance(value, bool) else "true or false"
    return None


def _is_sub_config(value) -> bool:
    """A nested config in to_dict() form (transformers writes model_type into each)."""
    return isinstance(value, dict) and "model_type" in value


def _merge_nested(target: dict, updates: dict) -> None:
    """vLLM's _update_nested: dicts into existing dicts, key by key; anything else set."""
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_nested(target[key], value)
        else:
            target[key] = value


def _folded(params: dict, overrides: dict) -> dict:
    """One flat rope_parameters dict with the legacy rope_scaling / rope_theta overrides in."""
    if "rope_scaling" in overrides:
        scaling = overrides["rope_scaling"]
        theta = params.get("rope_theta")
        params = {} if scaling is None else dict(scaling)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_type", "default")
        if theta is not None:
            params.setdefault("rope_theta", theta)
    if "rope_theta" in overrides:
        params = {**params, "rope_theta": overrides["rope_theta"]}
    return params


def _fold_legacy_rope(values: dict, overrides: dict) -> None:
    """An override of rope_scaling / rope_theta where the config keeps rope_parameters
    (transformers 5) goes there too, as vLLM's patch_rope_parameters does: else Kiln, which
    reads rope_parameters first, would not see it. Nested by layer type (Gemma-3), they are
    the global layers' (full_attention), as transformers reads them, and rope_local_base_freq
    the sliding layers' base."""
    params = values.get("rope_parameters")
    if not isinstance(params, dict) or "rope_parameters" in overrides:
        return
    if any(isinstance(v, dict) for v in params.values()):
        params = dict(params)
        if isinstance(params.get("full_attention"), dict):
            params["full_attention"] = _folded(params["full_attention"], overrides)
        if "rope_local_base_freq" in overrides and isinstance(params.get("sliding_attention"),
                                                              dict):
            params["sliding_attention"] = {**params["sliding_attention"],
                                           "rope_theta": overrides["rope_local_base_freq"]}
    else:
        params = _folded(params, overrides)
    values["rope_parameters"] = params


def apply_hf_overrides(hf_config, overrides: dict | None):
    """`hf_config` (a snapshot, or a transformers config) with `overrides` applied, as a new
    snapshot; unchanged when there are none."""
    if not overrides:
        return hf_config
    for key, value in overrides.items():
        if (must := _value_refused(key, value)) is not None:
            raise ConfigError(f"hf_overrides (--hf-overrides) {key} must be {must}, got "
                              f"{value!r}")
    snapshot = hf_config if isinstance(hf_config, HFConfigSnapshot) else snapshot_of(hf_config)
    values = snapshot.to_dict()
    for key, value in overrides.items():
        if _is_sub_config(values.get(key)) and isinstance(value, dict):
            _merge_nested(values[key], value)
        else:
            values[key] = value
    if any(key in overrides for key in _LEGACY_ROPE):
        _fold_legacy_rope(values, overrides)
    if "torch_dtype" in overrides and "dtype" not in overrides:
        # transformers 5's name, which Kiln reads first; its config's torch_dtype setter
        # writes dtype too (so vLLM's setattr of this override takes effect)
        values["dtype"] = overrides["torch_dtype"]
    return HFConfigSnapshot(values)

