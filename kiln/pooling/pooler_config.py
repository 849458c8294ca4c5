"""vLLM's `--runner pooling` (older `--task embed / classify / score`) and `--pooler-config`: which
runner the engine builds and how a pooling engine pools a prompt's final hidden states.

Kiln's models are decoders (Llama, Qwen2, Qwen3), so vLLM's defaults for a decoder pooling
model apply: LAST token, L2-normalized; a sentence-transformers checkpoint's own pooling
(1_Pooling/config.json, a Normalize module in modules.json) overrides them, as in vLLM.
A classify engine (pooling_task.py) runs the model's score head over the pooled state.
"""
import json
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError
from kiln.pooling.pooling_task import check_runner_fits, is_seq_cls

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task: embed, classify and score run the pooling runner (reward is refused).
_TASK_RUNNER = {None: "auto", "auto": "auto", "generate": "generate", "embed": "pooling",
                "classify": "pooling", "score": "pooling"}
# --pooler-config keys: vLLM's activation and softmax are older names of use_activation.
_KEYS = ("pooling_type", "normalize", "use_activation")
_ACTIVATION_ALIASES = ("activation", "softmax")
# sentence-transformers' 1_Pooling/config.json keys, by vLLM's pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True  # embed: L2-normalize the vector
    # "embed" (the pooled hidden state) or "classify" (the score head's logits over it)
    task: str = "embed"
    use_activation: bool = True  # classify: softmax / sigmoid over the logits (vLLM's)


def resolve_runner(runner: str | None, task: str | None, convert: str | None = None) -> str:
    """"generate" or "pooling" from vLLM's --runner, --convert and its older --task (Kiln's
    decoder architectures make auto the generate runner, as vLLM's *ForCausalLM do)."""
    if runner not in (None, *RUNNERS):
        raise ConfigError(f"--runner {runner!r} is not supported: give auto, generate or "
                          "pooling (Kiln has no draft runner)")
    if task not in _TASK_RUNNER:
        raise ConfigError(f"--task {task!r} is not supported: give generate, embed, classify "
                          "or score (reward needs a reward head Kiln's models lack)")
    from_task = _TASK_RUNNER[task]
    if convert not in (None, "auto", "none"):
        if from_task == "generate" or runner == "generate":
            raise ConfigError(f"--convert {convert} makes a pooling model: give --runner "
                              "pooling (or drop --runner generate / --task generate)")
        from_task = "pooling"
    runner = runner or "auto"
    if runner != "auto" and from_task != "auto" and runner != from_task:
        raise ConfigError(f"--runner {runner} and --task {task} disagree; give one of them")
    chosen = runner if runner != "auto" else from_task
    return "pooling" if chosen == "pooling" else "generate"


def auto_runner(runner: str | None, task: str | None, resolved: str,
                model_path: Path | None, architecture: str = "") -> str:
    """The runner once the checkpoint is known: an auto runner (no --runner, no --task) of a
    *ForSequenceClassification checkpoint, or of a sentence-transformers checkpoint (a
    modules.json Pooling module, as Qwen3-Embedding's, whose architecture is *ForCausalLM), is
    the pooling runner, as vLLM's _get_default_runner_type makes it; else `resolved`."""
    check_runner_fits(architecture, resolved, runner, task)
    if runner not in (None, "auto") or task not in (None, "auto"):
        return resolved
    if is_seq_cls(architecture):
        return "pooling"
    return "pooling" if "pooling_type" in checkpoint_pooling(model_path) else resolved


def _parse(spec, flag: str) -> dict:
    if spec is None:
        return {}
    if isinstance(spec, PoolerConfig):  # use_activation only where it is off (the default on)
        return {k: getattr(spec, k) for k in _KEYS
                if k != "use_activation" or not spec.use_activation}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} must be a JSON object, e.g. "
                              f"'{{\"pooling_type\": \"MEAN\", \"normalize\": true}}': {e}") from None
    if not isinstance(spec, dict):
        if hasattr(spec, "pooling_type"):  # vLLM's PoolerConfig object
            spec = {k: getattr(spec, k) for k in (*_KEYS, *_ACTIVATION_ALIASES)
                    if getattr(spec, k, None) is not None}
        else:
            raise ConfigError(f"{flag} must be a dict (JSON object), got {type(spec).__name__}")
    unknown = sorted(k for k, v in spec.items() if k not in (*_KEYS, *_ACTIVATION_ALIASES)
                     and v is not None)
    if unknown:
        raise ConfigError(f"{flag}: {unknown} not supported; Kiln's pooler takes pooling_type "
                          f"({', '.join(POOLING_TYPES)}), normalize and use_activation")
    out = {k: v for k, v in spec.items() if v is not None}
    for alias in _ACTIVATION_ALIASES:  # vLLM's older names
        if alias in out:
            value = out.pop(alias)
            if out.setdefault("use_activation", value) != value:
                raise ConfigError(f"{flag}: {alias} and use_activation disagree; give "
                                  "use_activation alone")
    if "pooling_type" in out:
        kind = out["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(f"{flag}: pooling_type {kind!r} is not supported; give one of "
                              f"{', '.join(POOLING_TYPES)}")
        out["pooling_type"] = kind.upper()
    for key in ("normalize", "use_activation"):
        if key in out and not isinstance(out[key], bool):
            raise ConfigError(f"{flag}: {key} must be true or false, got {out[key]!r}")
    return out


def pooler_config_json(pooler_config, override_pooler_config=None) -> str | None:
    """Both pooler configs (JSON text, dict or PoolerConfig) merged as resolve_pooler_config
    merges them, as one --pooler-config JSON for a child command line (the two flags share one
    destination, so writing both would keep only the last); None when neither says anything."""
    merged = {**_parse(override_pooler_config, "--override-pooler-config"),
              **_parse(pooler_config, "--pooler-config")}
    return json.dumps(merged) if merged else None


def checkpoint_pooling(model_path: Path | None) -> dict:
    """A sentence-transformers checkpoint's pooling (vLLM's get_pooling_config): its
    1_Pooling/config.json mode, and normalize where modules.json lists a Normalize module."""
    if model_path is None or not Path(model_path).is_dir():
        return {}
    path = Path(model_path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
        out = {"normalize": any("Normalize" in str(m.get("type", "")) for m in modules)}
        pooling = next((m for m in modules if "Pooling" in str(m.get("type", ""))), None)
        if pooling is not None:
            config = json.loads((path / pooling.get("path", "") / "config.json").read_text())
            kind = next((v for k, v in _ST_MODES.items() if config.get(k)), None)
            if kind is not None:
                out["pooling_type"] = kind
        return out
    except (OSError, ValueError, AttributeError):
        return {}  # unreadable: vLLM's defaults


def resolve_pooler_config(runner: str, pooler_config, override_pooler_config,
                          model_path: Path | None, task: str = "embed") -> PoolerConfig | None:
    """The pooling engine's PoolerConfig (None for the generate runner, which refuses one);
    `task`: pooling_task.pooling_task's."""
    given = {**_parse(override_pooler_config, "--override-pooler-config"),
             **_parse(pooler_config, "--pooler-config")}
    if runner != "pooling":
        if given:
            raise ConfigError("--pooler-config configures the pooling runner: add --runner "
                              "pooling (or --task embed)")
        return None
    # a cross-encoder's sentence-transformers files say nothing of its pooling
    found = checkpoint_pooling(model_path) if task == "embed" else {}
    return PoolerConfig(**{**found, **given, "task": task})


def matryoshka_dimensions(hf_config) -> tuple[bool, list[int] | None]:
    """(whether the model declares matryoshka embeddings, the sizes it lists or None), as
    vLLM reads them from the config (is_matryoshka / matryoshka_dimensions)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return bool(getattr(hf_config, "is_matryoshka", False) or dims), dims
