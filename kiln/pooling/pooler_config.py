"""vLLM's `--runner pooling` (older `--task embed`) and `--pooler-config`: which runner the engine
builds and how a pooling engine pools a prompt's final hidden states into one vector.

Kiln's models are decoders (Llama, Qwen2, Qwen3), so vLLM's defaults for a decoder embedding
model apply: LAST token, L2-normalized; a sentence-transformers checkpoint's own pooling
(1_Pooling/config.json, a Normalize module in modules.json) overrides them, as in vLLM.
"""
import json
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's tasks: "embed" is the pooling runner's; the others pool with heads Kiln's decoders lack.
_TASK_RUNNER = {None: "auto", "auto": "auto", "generate": "generate", "embed": "pooling"}
# sentence-transformers' 1_Pooling/config.json keys, by vLLM's pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True


def resolve_runner(runner: str | None, task: str | None) -> str:
    """"generate" or "pooling" from vLLM's --runner and its older --task (Kiln's decoder
    architectures make auto the generate runner, as vLLM's *ForCausalLM do)."""
    if runner not in (None, *RUNNERS):
        raise ConfigError(f"--runner {runner!r} is not supported: give auto, generate or "
                          "pooling (Kiln has no draft runner)")
    if task not in _TASK_RUNNER:
        raise ConfigError(f"--task {task!r} is not supported: Kiln's pooling runner embeds "
                          "(--task embed, or --runner pooling); classify / score / reward need "
                          "a model head its decoders lack")
    from_task = _TASK_RUNNER[task]
    runner = runner or "auto"
    if runner != "auto" and from_task != "auto" and runner != from_task:
        raise ConfigError(f"--runner {runner} and --task {task} disagree; give one of them")
    chosen = runner if runner != "auto" else from_task
    return "pooling" if chosen == "pooling" else "generate"


def auto_runner(runner: str | None, task: str | None, resolved: str,
                model_path: Path | None) -> str:
    """The runner once the checkpoint is known: an auto runner (no --runner, no --task) of a
    sentence-transformers checkpoint (a modules.json Pooling module, as Qwen3-Embedding's,
    whose architecture is *ForCausalLM) is the pooling runner, as vLLM's
    _get_default_runner_type makes it; else `resolved`."""
    if runner not in (None, "auto") or task not in (None, "auto"):
        return resolved
    return "pooling" if "pooling_type" in checkpoint_pooling(model_path) else resolved


def _parse(spec, flag: str) -> dict:
    if spec is None:
        return {}
    if isinstance(spec, PoolerConfig):
        return {"pooling_type": spec.pooling_type, "normalize": spec.normalize}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} must be a JSON object, e.g. "
                              f"'{{\"pooling_type\": \"MEAN\", \"normalize\": true}}': {e}") from None
    if not isinstance(spec, dict):
        if hasattr(spec, "pooling_type"):  # vLLM's PoolerConfig object
            spec = {k: getattr(spec, k) for k in ("pooling_type", "normalize")
                    if getattr(spec, k, None) is not None}
        else:
            raise ConfigError(f"{flag} must be a dict (JSON object), got {type(spec).__name__}")
    unknown = sorted(k for k, v in spec.items() if k not in ("pooling_type", "normalize")
                     and v is not None)
    if unknown:
        raise ConfigError(f"{flag}: {unknown} not supported; Kiln's pooler takes pooling_type "
                          f"({', '.join(POOLING_TYPES)}) and normalize")
    out = {k: v for k, v in spec.items() if v is not None}
    if "pooling_type" in out:
        kind = out["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(f"{flag}: pooling_type {kind!r} is not supported; give one of "
                              f"{', '.join(POOLING_TYPES)}")
        out["pooling_type"] = kind.upper()
    if "normalize" in out and not isinstance(out["normalize"], bool):
        raise ConfigError(f"{flag}: normalize must be true or false, got {out['normalize']!r}")
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
                          model_path: Path | None) -> PoolerConfig | None:
    """The pooling engine's PoolerConfig (None for the generate runner, which refuses one)."""
    given = {**_parse(override_pooler_config, "--override-pooler-config"),
             **_parse(pooler_config, "--pooler-config")}
    if runner != "pooling":
        if given:
            raise ConfigError("--pooler-config configures the pooling runner: add --runner "
                              "pooling (or --task embed)")
        return None
    return PoolerConfig(**{**checkpoint_pooling(model_path), **given})


def matryoshka_dimensions(hf_config) -> tuple[bool, list[int] | None]:
    """(whether the model declares matryoshka embeddings, the sizes it lists or None), as
    vLLM reads them from the config (is_matryoshka / matryoshka_dimensions)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return bool(getattr(hf_config, "is_matryoshka", False) or dims), dims
