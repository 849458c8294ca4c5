"""A checkpoint's HF config as plain data: resolved by transformers once, read back from Kiln's
cache without it, equal to transformers' own; a changed file, Kiln or transformers version gets
a new copy, a damaged copy is resolved again."""
import json
import pickle
import subprocess
import sys

import pytest

from kiln.config import hf_config_snapshot
from kiln.config.hf_config_snapshot import (
    HFConfigSnapshot,
    load_hf_dir_config,
    read_snapshot,
    snapshot_of,
)


def _refuse_transformers(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("transformers resolved the config again")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


@pytest.fixture
def checkpoint(tiny_llama_dir, tmp_path, monkeypatch):
    """A copy of the tiny checkpoint's config.json (so a test may edit it), and a fresh cache."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    return model


def _cache_files(tmp_path):
    return sorted((tmp_path / "cache" / "hf_config").glob("*/config.json"))


def test_second_load_reads_the_cache_and_matches_transformers(checkpoint, tmp_path, monkeypatch):
    from transformers import AutoConfig

    direct = AutoConfig.from_pretrained(checkpoint)
    first = load_hf_dir_config(checkpoint)
    with monkeypatch.context() as m:
        _refuse_transformers(m)
        second = load_hf_dir_config(checkpoint)
    assert first == second and len(_cache_files(tmp_path)) == 1
    assert second.to_dict() == json.loads(direct.to_json_string(use_diff=False))
    for name in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
                 "rope_parameters", "tie_word_embeddings", "architectures", "model_type"):
        assert getattr(second, name) == getattr(direct, name), name
    assert second.name_or_path == direct.name_or_path


def test_a_folder_name_of_the_longest_length_is_cached(checkpoint, tmp_path, monkeypatch):
    """A 252-byte folder name (84 CJK characters; a file name may have 255) plus the key made a
    cache folder name too long: the start failed with "File name too long"."""
    model = checkpoint.rename(checkpoint.with_name("模" * 84))
    first = load_hf_dir_config(model)
    with monkeypatch.context() as m:
        _refuse_transformers(m)
        assert load_hf_dir_config(model) == first
    [cached] = _cache_files(tmp_path)
    assert cached.parent.name.startswith("模" * 42 + "-")


def test_snapshot_reads_like_a_config_and_pickles_without_transformers(checkpoint):
    snap = load_hf_dir_config(checkpoint)
    assert getattr(snap, "no_such_field", "default") == "default"
    with pytest.raises(AttributeError, match="no_such_field"):
        _ = snap.no_such_field
    with pytest.raises(AttributeError, match="read-only"):
        snap.hidden_size = 1
    snap.to_dict()["hidden_size"] = -1  # a copy: the snapshot is unchanged
    assert snap.hidden_size > 0
    data = pickle.dumps(snap)
    assert pickle.loads(data) == snap
    # The core process unpickles it without importing transformers.
    code = ("import pickle, sys; snap = pickle.loads(sys.stdin.buffer.read()); "
            "print(snap.hidden_size, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True,
                         check=True).stdout.decode().split()
    assert out == [str(snap.hidden_size), "False"]


def test_a_changed_file_or_version_gets_a_new_copy(checkpoint, tmp_path, monkeypatch):
    first = load_hf_dir_config(checkpoint)
    values = json.loads((checkpoint / "config.json").read_text())
    values["rms_norm_eps"] = 1e-3
    (checkpoint / "config.json").write_text(json.dumps(values, indent=4))
    assert load_hf_dir_config(checkpoint).rms_norm_eps == 1e-3 != first.rms_norm_eps
    assert len(_cache_files(tmp_path)) == 2
    import kiln.version

    monkeypatch.setattr(kiln.version, "__version__", "0.0.0-other")
    assert load_hf_dir_config(checkpoint).rms_norm_eps == 1e-3
    assert len(_cache_files(tmp_path)) == 3
    real_version = hf_config_snapshot.importlib.metadata.version
    monkeypatch.setattr(hf_config_snapshot.importlib.metadata, "version",
                        lambda name: "0.0.0" if name == "transformers" else real_version(name))
    load_hf_dir_config(checkpoint)
    assert len(_cache_files(tmp_path)) == 4


@pytest.mark.parametrize("damage", ["truncated", "edited", "empty", "other_format"])
def test_a_damaged_copy_is_resolved_again(checkpoint, tmp_path, monkeypatch, caplog, damage):
    good = load_hf_dir_config(checkpoint)
    (path,) = _cache_files(tmp_path)
    text = path.read_text()
    saved = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "edited":  # valid JSON, a value changed without its checksum
        saved["config"]["hidden_size"] += 1
        path.write_text(json.dumps(saved))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        saved["format"] = -1
        path.write_text(json.dumps(saved))
    with pytest.raises(ValueError):
        read_snapshot(path)
    assert load_hf_dir_config(checkpoint) == good
    assert "unusable" in caplog.text
    assert read_snapshot(path) == good  # rewritten whole


def test_engine_config_holds_a_snapshot(tiny_llama_dir, tmp_path, monkeypatch):
    from kiln.config import ModelConfig

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    cfg = ModelConfig(model=str(tiny_llama_dir))
    assert isinstance(cfg.hf_config, HFConfigSnapshot)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.hidden_size == cfg.hf_config.hidden_size


def test_snapshot_of_goes_through_json():
    from transformers import LlamaConfig

    snap = snapshot_of(LlamaConfig(num_hidden_layers=2))
    assert snap.num_hidden_layers == 2 and all(isinstance(k, str) for k in snap.id2label)
    assert isinstance(snap, HFConfigSnapshot)


def test_a_snapshot_rebuilds_as_transformers_config(checkpoint):
    from transformers import AutoConfig, LlamaConfig

    from kiln.config.hf_config_snapshot import as_transformers_config

    rebuilt = as_transformers_config(load_hf_dir_config(checkpoint))
    direct = AutoConfig.from_pretrained(checkpoint)
    assert isinstance(rebuilt, LlamaConfig)
    assert rebuilt.to_diff_dict() == direct.to_diff_dict()


@pytest.mark.parametrize("edit, names", [
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, "hidden size .64."),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps"),
    # its validator divides by the head count: a ZeroDivisionError traceback
    ({"num_attention_heads": 0}, "ZeroDivisionError: integer modulo by zero"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "factor"),
    (None, "not a valid JSON file"),
])
def test_a_config_transformers_refuses_is_a_config_error_naming_the_file(checkpoint, edit, names):
    # transformers' own validation (a StrictDataclassError, a KeyError, an OSError) was not a
    # ValueError: `kiln generate` printed its traceback for the user's config.json
    from kiln.errors import ConfigError

    config_json = checkpoint / "config.json"
    if edit is None:
        config_json.write_text('{"architectures": [')
    else:
        config_json.write_text(json.dumps({**json.loads(config_json.read_text()), **edit}))
    with pytest.raises(ConfigError, match=names) as e:
        load_hf_dir_config(checkpoint)
    assert str(config_json) in str(e.value)


def test_a_model_type_transformers_lacks_is_refused_naming_what_kiln_serves(checkpoint):
    """transformers' refusal advised `pip install --upgrade transformers`, which gives Kiln no
    model of that type."""
    from kiln.errors import ConfigError

    config_json = checkpoint / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()),
                                       "model_type": "foo", "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"model_type 'foo' is not supported; Kiln serves "
                       r".*GemmaForCausalLM, .*LlamaForCausalLM") as e:
        load_hf_dir_config(checkpoint)
    assert str(config_json) in str(e.value) and "upgrade" not in str(e.value)
