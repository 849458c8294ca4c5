"""The GGUF conversion cache stays bounded: a file's older conversions go when a new one is made
(each about 6.6 times the file with its weight snapshot), as do temporaries a killed process left;
nothing another file, an older Kiln or a live process may use is touched."""
import os
import subprocess
import time

import pytest

from kiln.config import gguf_metadata
from kiln.model.loader import get_model
from model._attn_helper import kiln_config_for
from model.test_gguf_vs_hf import write_gguf

from checkpoints import make_tiny_checkpoint


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    return make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _temporary(folder, name: str, pid: int, age_s: float):
    """A temporary as atomic_write.temporary_beside names it, last written `age_s` ago."""
    tmp = folder / f".{name}.{pid}.140000000000000.tmp"
    tmp.write_bytes(b"x" * 100)
    os.utime(tmp, (time.time() - age_s, time.time() - age_s))
    return tmp


def test_a_changed_files_older_conversion_is_removed(hf_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    (tmp_path / "elsewhere").mkdir()
    other = write_gguf(tmp_path / "elsewhere" / "m.gguf", hf_dir)  # another file, same name
    gguf_metadata.load_config(path)
    gguf_metadata.load_config(other)
    first, others = gguf_metadata.converted_dir(path), gguf_metadata.converted_dir(other)
    assert (first / "source").read_text().split("\n")[0] == str(path.resolve())
    older_kiln = first.with_name("m-0123456789abcdef")  # a folder without a record: left alone
    older_kiln.mkdir()
    time.sleep(0.05)
    os.utime(path)  # touched (or moved, re-downloaded): a new conversion
    second = gguf_metadata.converted_dir(path)
    assert second != first
    gguf_metadata.load_config(path)
    assert second.is_dir() and not first.exists()
    assert others.is_dir() and older_kiln.is_dir()


def test_another_installs_conversion_of_the_same_file_is_kept(hf_dir, tmp_path, monkeypatch):
    """Two installs (Kiln, transformers or gguf versions) sharing the cache deleted each other's
    conversions at every start, weight snapshots and all (helper-54)."""
    from kiln import version

    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    folders = []
    for v in ("9.0.0", "9.0.1", "9.0.0"):
        monkeypatch.setattr(version, "__version__", v)
        gguf_metadata.load_config(path)
        folders.append(gguf_metadata.converted_dir(path))
    assert folders[0] == folders[2] != folders[1]
    assert all(f.is_dir() for f in folders)


def test_a_folder_a_live_process_writes_in_is_kept(hf_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    gguf_metadata.load_config(path)
    first = gguf_metadata.converted_dir(path)
    _temporary(first, "weights-0123456789abcdef.safetensors", os.getpid(), 3600)
    time.sleep(0.05)
    os.utime(path)
    gguf_metadata.load_config(path)
    assert first.is_dir() and gguf_metadata.converted_dir(path).is_dir()


def test_temporaries_of_writers_that_died_are_swept_before_saving(hf_dir, tmp_path):
    """A load killed while saving its weight snapshot left a temporary of the model's size,
    forever (and it took the free space the next save checks)."""
    path = write_gguf(tmp_path / "m.gguf", hf_dir, {"ffn_up": "Q8_0"})
    cfg = kiln_config_for(path)
    folder = gguf_metadata.converted_dir(path)
    dead = _dead_pid()
    left = _temporary(folder, "weights-0123456789abcdef.safetensors", dead, 3600)
    left_dir = folder / f".tokenizer.{dead}.140000000000000.tmp"  # a conversion's folder
    left_dir.mkdir()
    (left_dir / "tokenizer.json").write_text("{}")
    os.utime(left_dir, (time.time() - 3600, time.time() - 3600))
    live = _temporary(folder, "weights-0123456789abcdef.safetensors", os.getpid(), 3600)
    recent = _temporary(folder, "weights-fedcba9876543210.safetensors", dead, 0)
    unnamed = folder / ".not-a-temporary.tmp"  # no writer in its name: not Kiln's to judge
    unnamed.write_text("x")
    get_model(cfg)  # saves the snapshot
    assert not left.exists() and not left_dir.exists()
    assert live.exists() and recent.exists() and unnamed.exists()


def test_a_gguf_file_name_of_the_longest_length_is_converted_and_kept(hf_dir, tmp_path):
    """A 255-byte file name gave a 267-byte conversion folder name: "File name too long"."""
    path = write_gguf(tmp_path / ("q" * 250 + ".gguf"), hf_dir)
    gguf_metadata.load_config(path)
    folder = gguf_metadata.converted_dir(path)
    assert folder.name.startswith("q" * 128 + "-") and (folder / "source").is_file()
