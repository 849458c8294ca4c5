"""A model's HF config as transformers resolved it, kept as plain data (JSON) on disk and read
back without importing transformers' model classes: a second of imports in each process.

`LlamaConfig` alone imports torch.distributed.tensor through transformers' validators (0.9 s on
2 cores) in the front end, and again in the core to unpickle it. The first start resolves the
config with transformers and keeps `to_dict()` under <cache root>/hf_config/<name>-<key>/ (key:
the config file's identity (path, size, mtime, inode, ctime), the transformers and Kiln
versions, the format); later starts read that file, checked against the sha256 it holds (a
damaged one is resolved again).
"""
import copy
import hashlib
import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln import envs
from kiln.atomic_write import atomic_write_text
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

_FORMAT = 1  # of the saved file


class HFConfigSnapshot:
    """Read-only attribute access to a resolved config's `to_dict()`: what the engine reads
    (`hf_config.hidden_size`, `getattr(hf_config, "rope_parameters", None)`) answers as the
    transformers object did; pickles as plain data, so the core process needs no transformers."""

    __slots__ = ("_values",)

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"the model config has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError(f"the model config is read-only (setting {name!r})")

    def __reduce__(self):
        return HFConfigSnapshot, (self._values,)

    def __eq__(self, other) -> bool:
        return isinstance(other, HFConfigSnapshot) and self._values == other._values

    def __hash__(self):
        return None  # mutable values inside: unhashable, as transformers' configs

    def __repr__(self) -> str:
        return f"HFConfigSnapshot({self._values.get('model_type')!r}, {len(self._values)} fields)"

    @property
    def name_or_path(self) -> str:
        return self._values.get("_name_or_path", "")

    def to_dict(self) -> dict:
        return copy.deepcopy(self._values)


def snapshot_of(config) -> HFConfigSnapshot:
    """The snapshot of a transformers config, through JSON as the saved copy is (so the first
    start and a cached one give equal values: JSON turns id2label's int keys into strings)."""
    return HFConfigSnapshot(json.loads(config.to_json_string(use_diff=False)))


def _digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def write_snapshot(snapshot: HFConfigSnapshot, path: Path) -> None:
    """`path` (a JSON file) holds the config and its checksum; written atomically."""
    values = snapshot.to_dict()
    atomic_write_text(path, json.dumps({"format": _FORMAT, "sha256": _digest(values),
                                        "config": values}))


def read_snapshot(path: Path) -> HFConfigSnapshot:
    """The snapshot saved at `path`; ValueError when its format or checksum does not match."""
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
        raise ValueError("not a config snapshot of this format")
    values = saved.get("config")
    if not isinstance(values, dict) or _digest(values) != saved.get("sha256"):
        raise ValueError("config does not match its checksum")
    return HFConfigSnapshot(values)


def source_key(source: Path, *extra: str) -> str:
    """A key that changes with the file (path, size, mtime, inode, ctime), transformers, Kiln
    and `extra`.

    Size and mtime alone missed a file replaced or rewritten with its old size and mtime (`cp
    -p`, `rsync -t`, `tar x` of a re-converted file, an edit followed by os.utime): the old
    conversion was used. A file replaced whole has another inode; one rewritten in place gets a
    new ctime, which, unlike mtime, nothing can set back."""
    from kiln.version import __version__

    source = source.resolve()
    factors = "|".join([str(source), file_identity(source),
                        importlib.metadata.version("transformers"), __version__, str(_FORMAT),
                        *extra])
    return hashlib.sha256(factors.encode()).hexdigest()[:16]


# Bytes of a model's name a cache folder's name keeps: with "-" and the 16-character key it
# stays under the 255 bytes a file name may have (a longer model folder or file name failed the
# start with "File name too long"); the key alone tells entries apart.
_NAME_BYTES = 128


def cache_entry_name(name: str, key: str) -> str:
    """`name`-`key`, the name cut (at a character boundary) to what a file name holds."""
    short = name.encode()[:_NAME_BYTES].decode(errors="ignore")
    return f"{short}-{key}"


def file_identity(source: Path) -> str:
    """What changes when the file at `source` does: size, mtime, inode and ctime."""
    stat = source.stat()
    return "|".join(map(str, (stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)))


def cached_snapshot(path: Path, resolve: Callable[[], Any]) -> HFConfigSnapshot:
    """The snapshot saved at `path`, or `resolve()` (a transformers config, or a snapshot)
    snapshotted and saved there; a damaged or unreadable copy is resolved again."""
    if path.is_file():
        try:
            return read_snapshot(path)
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            logger.warning("cached model config %s unusable (%s); resolving it again", path, e)
    resolved = resolve()
    snapshot = resolved if isinstance(resolved, HFConfigSnapshot) else snapshot_of(resolved)
    try:
        write_snapshot(snapshot, path)
    except OSError as e:
        logger.debug("could not keep the model config at %s: %s", path, e)
    return snapshot


def config_refused(e: Exception, source: Path) -> ConfigError:
    """transformers' refusal `e` of the config in `source` (its validators' StrictDataclassError:
    heads that do not divide hidden_size, a field of the wrong type) as one line naming it."""
    cause = " ".join(str(e).split())
    return ConfigError(f"{source} is not a model config transformers accepts "
                       f"({type(e).__name__}: {cause}); fix the file")


def load_hf_dir_config(model_dir: Path) -> HFConfigSnapshot:
    """AutoConfig of a checkpoint directory, cached by its config.json."""
    config_json = model_dir / "config.json"
    path = (envs.cache_root() / "hf_config" /
            cache_entry_name(model_dir.resolve().name, source_key(config_json)) / "config.json")

    def resolve():
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        from kiln.config.remote_code import checkpoint_code_message, needs_checkpoint_code
        from kiln.model.registry import supported_architectures

        try:
            return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        except ValueError as e:
            if "does not recognize this architecture" in str(e):
                # transformers advised upgrading itself: no upgrade gives Kiln that model
                model_type = json.loads(config_json.read_text()).get("model_type")
                raise ConfigError(f"{config_json}: model_type {model_type!r} is not supported; "
                                  f"Kiln serves {', '.join(supported_architectures())}") from None
            if not needs_checkpoint_code(e):
                raise
            raise ConfigError(f"{checkpoint_code_message(config_json, 'model config')}; "
                              f"Kiln serves {', '.join(supported_architectures())}") from None
        except FileNotFoundError:
            raise
        except (StrictDataclassError, KeyError, TypeError, AttributeError, OSError,
                ArithmeticError) as e:
            # transformers reading the user's config.json (a rope missing its factor, a file
            # that is not JSON, num_attention_heads 0 dividing hidden_size in a validator that
            # raises ZeroDivisionError): theirs to fix, so one line, not a transformers traceback.
            raise config_refused(e, config_json) from e
    return cached_snapshot(path, resolve)


def as_transformers_config(hf_config):
    """transformers' config object for `hf_config` (a snapshot rebuilt as its model type's
    class; anything else as it is): for code that hands it to transformers (the HF baseline)."""
    if not isinstance(hf_config, HFConfigSnapshot):
        return hf_config
    from transformers import AutoConfig

    values = hf_config.to_dict()
    return AutoConfig.for_model(values.pop("model_type"), **values)
