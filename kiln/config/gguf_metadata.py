"""A GGUF file's HF config, tokenizer and tensor table, converted once and kept as files.

Each needs all of the file's metadata parsed: 2.5 s per parse for the default model on 2 cores
(its 49k-token vocabulary), by transformers for the config and the tokenizer and by `gguf` for
the weights' table, on every start. The first start saves what it converted under
<cache root>/gguf/<stem>-<key>/ (key: the file's identity, hf_config_snapshot.source_key, and
the transformers, gguf and Kiln versions); later starts read those files (the config as plain
data: hf_config_snapshot.py).
"""
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln import envs
from kiln.atomic_write import temporary_beside
from kiln.config import gguf_arch_config, gguf_checks, gguf_moe_config
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

# Of what is kept; 2: rope scaling metadata in the table, 3: missing metadata, 4: the config
# as a snapshot (config/config.json in hf_config_snapshot's format), 5: the head size, 6: the
# metadata gguf_checks reads, 7: more of it (sizes' types, token ids), 8: tensors' dims,
# 9: the tokenizer's model and pre-tokenizer type (a tokenizer kept before splits no digits),
# 10: rope scaling read as llama.cpp reads it (rope.scale_linear, a missing type or factor),
# 11: rope.dimension_count, 12: gguf_arch_config's metadata (Phi-3, Gemma, Granite, OLMo-2),
# 13: Gemma-2 / 3's (soft caps, window), 14: gguf_moe_config's (the experts' counts and sizes),
# 15: gguf_family_fields' (windows and their per-layer pattern's values), 16: GLM-4's and
# Seed-Coder's splits (gguf_tokenizer.REGEX_SPLIT_PRE_TYPES; a tokenizer kept before had GPT-2's).
_FORMAT = 16


def converted_dir(gguf: Path) -> Path:
    """Where this file's conversion is kept; a changed file (source_key) gets a new one."""
    from kiln.config.hf_config_snapshot import cache_entry_name, source_key

    # Both libraries parse the file: a new gguf may lay its tensors out differently.
    key = source_key(gguf, importlib.metadata.version("gguf"), f"gguf{_FORMAT}")
    return envs.cache_root() / "gguf" / cache_entry_name(gguf.resolve().stem, key)


def _cached(gguf: Path, name: str, load: Callable[[Path], Any], convert: Callable[[], Any],
            save: Callable[[Any, Path], None]) -> Any:
    """`load(part)` for the part `name` of the file's conversion when a saved copy exists (a
    damaged one is converted again), else `convert()`, saved to it by writing a temporary
    directory and renaming it."""
    from kiln.config import gguf_cache_cleanup

    part = converted_dir(gguf) / name
    if part.is_dir():
        try:
            return load(part)
        except Exception as e:  # a damaged copy (any parser's error) must not stop the engine
            logger.warning("cached GGUF conversion %s unusable (%s: %s); converting again", part,
                           type(e).__name__, e)
            shutil.rmtree(part, ignore_errors=True)
    value = convert()
    tmp = None
    try:
        # a new folder: older conversions of the same path go
        gguf_cache_cleanup.claim(part.parent, gguf)
        gguf_cache_cleanup.sweep(part.parent)
        tmp = temporary_beside(part)  # names its writer: a killed one's is swept
        shutil.rmtree(tmp, ignore_errors=True)  # left by a dead process that had this pid
        tmp.mkdir()
        save(value, tmp)
        os.rename(tmp, part)  # atomic; another process may have won the race: keep its copy
        tmp = None
    except OSError as e:
        logger.debug("could not keep the GGUF conversion at %s: %s", part, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return value


def load_config(gguf: Path):
    """AutoConfig of a .gguf file, as an HFConfigSnapshot (converted once, then read back)."""
    from kiln.config.hf_config_snapshot import cached_snapshot

    table = load_tensor_table(gguf)
    gguf_checks.check_file(table, gguf)
    gguf_checks.check_metadata(table, gguf)

    def convert():
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        from kiln.config.hf_config_snapshot import config_refused

        try:
            if table["architecture"] in gguf_arch_config.OWN_CONFIG_ARCHITECTURES:
                config = gguf_arch_config.build_config(table)  # transformers converts none
            elif gguf_moe_config.is_moe(table):
                config = gguf_moe_config.build_config(table)  # transformers' misses sizes
            else:
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                    trust_remote_code=False)
        except StrictDataclassError as e:  # its validators: head_count not dividing, ...
            raise config_refused(e, gguf) from e
        config.name_or_path = str(gguf.parent)  # what transformers names it
        if table["architecture"] == "phi3":
            gguf_arch_config.complete_phi3(config, table, gguf)
        apply_rope_scaling(config, table.get("rope_scaling"))
        _apply_head_size(config, table.get("head_size"), gguf)
        _check_rotary_dims(config, table, gguf)
        return config
    return cached_snapshot(converted_dir(gguf) / "config" / "config.json", convert)


def apply_rope_scaling(config, scaling: dict | None) -> None:
    """Put the file's `{arch}.rope.scaling.*` metadata into the config, which transformers'
    GGUF conversion drops: a linearly scaled model would run unscaled, positions all wrong
    (and a yarn one is refused, not served unscaled)."""
    if not scaling or scaling.get("rope_type") in (None, "none"):
        return
    if scaling["rope_type"] == "yarn":
        # llama.cpp's yarn keys (attn_factor, yarn_beta_*, yarn_log_multiplier) are not mapped
        raise ConfigError("rope_scaling type 'yarn' is not supported in a GGUF file (its yarn "
                          "metadata is not mapped to HF's); serve the model's Hugging Face "
                          "checkpoint, whose yarn scaling Kiln runs")
    from kiln.config.rope import rope_nested

    params = getattr(config, "rope_parameters", None)  # transformers 5
    if rope_nested(config):  # Gemma-3: llama.cpp scales the global layers only
        params = params.get("full_attention")
    current = params if isinstance(params, dict) and params else (
        getattr(config, "rope_scaling", None) or {})
    if current.get("rope_type", current.get("type", "default")) != "default":
        return  # transformers converted it after all
    if isinstance(params, dict) and params:
        params.update(scaling)
    else:
        config.rope_scaling = dict(scaling)


def _apply_head_size(config, head_size: dict | None, gguf: Path) -> None:
    """Put the file's `{arch}.attention.key_length` into the config, which transformers' GGUF
    conversion drops: its default (hidden / heads for Llama, 128 for Qwen3) failed to load every
    file whose heads are another size (Mistral Nemo: 5120 hidden, 32 heads of 128)."""
    if not head_size or head_size.get("key") is None:
        return
    key, value = head_size["key"], head_size.get("value")
    if value is not None and value != key:
        raise ConfigError(f"GGUF file {gguf}: attention.key_length {key} differs from "
                          f"attention.value_length {value}; Kiln's attention needs them equal")
    config.head_dim = int(key)


def _check_rotary_dims(config, table: dict, gguf: Path) -> None:
    """Refuse a file that ropes another part of each head (`{arch}.rope.dimension_count`) than
    its config's model does (the whole head; GLM-4's partial_rotary_factor of it): llama.cpp
    ropes that many dimensions (and refuses it for llama); such a file ran with every position
    rotated wrong."""
    from kiln.config.rope import partial_rotary_factor_of

    key = f"{table['architecture']}.rope.dimension_count"
    rotary = table["metadata"].get(key, {}).get("value")
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    roped = int(head_dim * partial_rotary_factor_of(config))
    if rotary is not None and rotary != roped:
        model = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise ConfigError(f"GGUF file {gguf}: {key} is {rotary}, but Kiln's {model} ropes "
                          f"{roped} of each head's {head_dim} dimensions (a partial rotary "
                          "embedding is read from GLM-4 files only)")


def load_tokenizer(gguf: Path):
    """AutoTokenizer (vocabulary, special tokens, chat template) of a .gguf file."""
    from kiln.config import gguf_tokenizer

    value = _cached(gguf, "tokenizer", gguf_tokenizer.read,
                    lambda: gguf_tokenizer.convert(gguf, load_tensor_table(gguf)),
                    lambda converted, path: converted.save_pretrained(path))
    value.name_or_path = str(gguf.parent)  # what transformers names it, not the cache's path
    return value


def _tensor_table(gguf_path: Path) -> dict:
    """Where each tensor's bytes lie, as gguf's reader lays them out: {"architecture",
    "tensors": [{name, type, dtype, shape, dims, offset, nbytes}]}, offsets absolute in the
    file; and the metadata start-up checks ("metadata": gguf_checks' keys, summarised)."""
    from kiln.config.gguf_reader import open_gguf

    reader = open_gguf(gguf_path)
    field = reader.fields.get("general.architecture")
    arch = None if field is None else str(field.contents())
    return {"architecture": arch, "rope_scaling": _rope_scaling_fields(reader, arch),
            "head_size": {"key": _field(reader, f"{arch}.attention.key_length"),
                          "value": _field(reader, f"{arch}.attention.value_length")},
            "tokenizer": {"model": _field(reader, "tokenizer.ggml.model"),
                          "pre": _field(reader, "tokenizer.ggml.pre")},
            "metadata": {key: _summary(reader.fields[key])
                         for key in gguf_checks.metadata_keys(arch)
                         + gguf_arch_config.metadata_keys(arch)
                         + gguf_moe_config.metadata_keys(arch) if key in reader.fields},
            "tensors": [{"name": t.name, "type": int(t.tensor_type), "dtype": t.data.dtype.str,
                         "shape": list(t.data.shape), "dims": _dims(t),
                         "offset": int(t.data_offset),
                         "nbytes": int(t.n_bytes)} for t in reader.tensors]}


def _dims(tensor) -> list[int]:
    """A tensor's shape in values, outermost first as HF and torch order it (`shape` is the
    bytes' as gguf presents them: rows of blocks for a quantized tensor)."""
    return [int(d) for d in reversed(tensor.shape.tolist())]


def _summary(field) -> dict:
    """A metadata field as JSON: {"type": gguf's value type name, and "value" for one value or
    "count" for an array} (an array's values are not read: a vocabulary's are 2.5 s; a bool
    array's, one per layer such as a sliding-window pattern, are: "values")."""
    import gguf

    kind = gguf.GGUFValueType(field.types[0]).name
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        summary = {"type": kind, "count": len(field.data)}
        if field.types[1:] == [gguf.GGUFValueType.BOOL]:
            summary["values"] = [bool(v) for v in field.contents()]
        return summary
    return {"type": kind, "value": field.contents()}


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _rope_scaling_fields(reader, arch: str | None) -> dict | None:
    """{"rope_type", "factor", "original_max_position_embeddings"} as HF names them, from
    `{arch}.rope.scaling.*`, read as llama.cpp reads them: the type "linear" where the file has
    none, the factor from the older `{arch}.rope.scale_linear` where it has no
    `rope.scaling.factor` (2023 conversions of linearly scaled models), and a missing or 0
    factor no scaling. None when the file has none. (A linear type without a factor failed with
    KeyError 'factor'; a file with only rope.scale_linear ran unscaled, every position wrong.)"""
    def value(key: str):
        return _field(reader, f"{arch}.rope.scaling.{key}")

    factor = value("factor")
    if factor is None:
        factor = _field(reader, f"{arch}.rope.scale_linear")
    rope_type = str(value("type") or "linear")
    if rope_type in ("linear", "none") and not factor:  # 1 / 0 is no scaling, as in llama.cpp
        return None
    scaling = {"rope_type": rope_type}
    if factor is not None:
        scaling["factor"] = factor
    if value("original_context_length") is not None:
        scaling["original_max_position_embeddings"] = value("original_context_length")
    return scaling


def _table_digest(table: dict) -> str:
    # The table keeps its own checksum: one edited or damaged into other valid offsets would
    # load the wrong bytes as weights without a word.
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


def _table_text(table: dict) -> str:
    return json.dumps({"sha256": _table_digest(table), "table": table})


def _read_table(part: Path, file_size: int) -> dict:
    saved = json.loads((part / "tensors.json").read_text())
    table = saved["table"]
    if _table_digest(table) != saved["sha256"]:
        raise ValueError("tensor table does not match its checksum")
    for t in table["tensors"]:
        if t["offset"] + t["nbytes"] > file_size:
            raise ValueError(f"tensor {t['name']} lies past the end of the file")
    return table


def load_tensor_table(gguf_path: Path) -> dict:
    """The file's architecture and tensor table (see `_tensor_table`)."""
    return _cached(gguf_path, "tensors",
                   lambda part: _read_table(part, gguf_path.stat().st_size),
                   lambda: _tensor_table(gguf_path),
                   lambda table, path: (path / "tensors.json").write_text(_table_text(table)))
