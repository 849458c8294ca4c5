"""The weight snapshot of a GGUF model: a second load maps what the first saved and equals a load
from the file; a damaged, truncated or stale snapshot is loaded past (from the file) and replaced."""
import json
import os
import struct

import pytest
import torch

from kiln.model.layers import cpu_gemm
from kiln.model.loader import get_model, snapshot_crc, weight_snapshot
from model._attn_helper import kiln_config_for
from model.test_gguf_vs_hf import write_gguf

_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
            "output")


@pytest.fixture
def gguf_cfg(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "q8.gguf", tiny_llama_dir, {p: "Q8_0" for p in _LINEARS})
    return kiln_config_for(path, tokenizer=str(tiny_llama_dir))


def _state(model) -> dict:
    """Every plain tensor the model holds (by module and name), what each linear holds for the
    native kernels, and the modules' plain attributes."""
    tensors = {}
    for path, module in model.named_modules(remove_duplicate=False):
        plain = [(k, v) for k, v in vars(module).items()
                 if not k.startswith("_") and isinstance(v, torch.Tensor)]  # inv_freq
        for name, t in [*module._parameters.items(), *module._buffers.items(), *plain]:
            if t is None or t.is_meta or t.layout != torch.strided:
                tensors[f"{path}.{name}"] = None if t is None else (t.shape, t.dtype, t.layout)
            else:
                tensors[f"{path}.{name}"] = t.detach().clone()
    held = {p: cpu_gemm.held(m) for p, m in model.named_modules() if hasattr(m, "cpu_plan")}
    return {"tensors": tensors, "held": held, "attrs": weight_snapshot.primitive_attrs(model)}


def _assert_same(a: dict, b: dict) -> None:
    assert a["held"] == b["held"] and a["attrs"] == b["attrs"]
    assert a["tensors"].keys() == b["tensors"].keys()
    for name, x in a["tensors"].items():
        y = b["tensors"][name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x == y, name


def _fresh(cfg, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        m.setenv("KILN_WEIGHT_SNAPSHOT", "0")
        return _state(get_model(cfg))


def _no_file_loads(monkeypatch):
    """Make loading from the model file fail: what loads after this came from the snapshot."""
    import kiln.model.loader as loader

    def refuse(*_):
        raise AssertionError("loaded from the model file")

    monkeypatch.setattr(loader, "load_weights_into", refuse)


def _crc(path) -> int:
    with open(path, "rb") as f:
        return snapshot_crc.file_crc(f)


def _snapshots(cfg) -> list:
    path = weight_snapshot.snapshot_path(cfg)
    return sorted(path.parent.glob(f"{path.stem}-*{path.suffix}"))


def test_second_load_maps_the_first_loads_snapshot(gguf_cfg, monkeypatch):
    fresh = _fresh(gguf_cfg, monkeypatch)
    assert _snapshots(gguf_cfg) == []  # KILN_WEIGHT_SNAPSHOT=0 saved nothing
    _assert_same(_state(get_model(gguf_cfg)), fresh)  # loads the file and saves
    [saved] = _snapshots(gguf_cfg)
    assert snapshot_crc.find(weight_snapshot.snapshot_path(gguf_cfg)) == (saved, _crc(saved))
    _no_file_loads(monkeypatch)
    restored = get_model(gguf_cfg)
    _assert_same(_state(restored), fresh)
    # the blocks the small-batch kernel reads came back with the weights
    assert any(cpu_gemm.held(m).blocks for m in restored.modules() if hasattr(m, "cpu_plan"))


def test_damaged_snapshot_is_loaded_past_and_saved_again(gguf_cfg, monkeypatch, caplog):
    fresh = _fresh(gguf_cfg, monkeypatch)
    get_model(gguf_cfg)
    [saved] = _snapshots(gguf_cfg)
    data = bytearray(saved.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x40  # one bit inside the weights
    saved.write_bytes(bytes(data))
    _assert_same(_state(get_model(gguf_cfg)), fresh)  # the CRC caught it: loaded from the file
    assert "CRC mismatch" in caplog.text
    [again] = _snapshots(gguf_cfg)
    assert _crc(again) == int(again.stem.rsplit("-", 1)[1], 16)
    _no_file_loads(monkeypatch)
    _assert_same(_state(get_model(gguf_cfg)), fresh)


def test_a_header_pointing_a_weight_at_another_tensor_is_caught(gguf_cfg, monkeypatch, caplog):
    """Two same-shaped norms swapped in the manifest: every structural check passes, the CRC
    (over the header too) does not."""
    fresh = _fresh(gguf_cfg, monkeypatch)
    get_model(gguf_cfg)
    [saved] = _snapshots(gguf_cfg)
    data = saved.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    slots = json.loads(json.loads(data[8:8 + n])["__metadata__"]["manifest"])["slots"]
    a, b = (f"model.layers.0.{x}_layernorm|p|weight" for x in ("input", "post_attention"))
    ka, kb = slots[a], slots[b]
    assert len(ka) == len(kb) and ka != kb
    header = data[8:8 + n]
    for slot, old, new in ((a, ka, kb), (b, kb, ka)):
        entry = f'{slot}\\": \\"{{}}\\"'
        assert header.count(entry.format(old).encode()) == 1
        header = header.replace(entry.format(old).encode(), entry.format(new).encode())
    saved.write_bytes(data[:8] + header + data[8 + n:])
    _assert_same(_state(get_model(gguf_cfg)), fresh)
    assert "CRC mismatch" in caplog.text
    _no_file_loads(monkeypatch)
    _assert_same(_state(get_model(gguf_cfg)), fresh)  # saved again, whole


@pytest.mark.parametrize("damage", ["truncated", "stale"])
def test_unusable_snapshot_is_removed_and_the_file_loaded(gguf_cfg, monkeypatch, damage):
    fresh = _fresh(gguf_cfg, monkeypatch)
    get_model(gguf_cfg)
    [saved] = _snapshots(gguf_cfg)
    if damage == "truncated":
        saved.write_bytes(saved.read_bytes()[:-1000])
    else:  # saved by a model with another layer: a slot this model does not have
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(saved), framework="pt") as f:
            manifest = json.loads(f.metadata()["manifest"])
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        manifest["slots"]["model.layers.9|p|weight"] = None
        save_file(tensors, str(saved), metadata={"manifest": json.dumps(manifest)})
    _assert_same(_state(get_model(gguf_cfg)), fresh)
    _no_file_loads(monkeypatch)
    _assert_same(_state(get_model(gguf_cfg)), fresh)  # saved again, whole


def test_snapshot_kept_only_for_a_whole_gguf_model_in_its_own_key(gguf_cfg, tiny_llama_dir,
                                                                  monkeypatch):
    path = weight_snapshot.snapshot_path(gguf_cfg)
    assert path is not None
    assert weight_snapshot.snapshot_path(kiln_config_for(tiny_llama_dir)) is None  # safetensors
    bf16 = kiln_config_for(gguf_cfg.model_config.model_path, dtype="bfloat16",
                           tokenizer=str(tiny_llama_dir))
    assert weight_snapshot.snapshot_path(bf16) not in (None, path)
    int8 = kiln_config_for(gguf_cfg.model_config.model_path, quantization="int8",
                           tokenizer=str(tiny_llama_dir))
    assert weight_snapshot.snapshot_path(int8) is None  # quantized on load: not kept
    monkeypatch.setenv("KILN_WEIGHT_SNAPSHOT", "0")
    assert weight_snapshot.snapshot_path(gguf_cfg) is None


def test_a_snapshot_that_cannot_be_saved_leaves_the_load_alone(gguf_cfg, monkeypatch):
    import safetensors.torch

    fresh = _fresh(gguf_cfg, monkeypatch)

    def fail(*_, **__):
        raise RuntimeError("Some tensors share memory")  # what safetensors says of views

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    _assert_same(_state(get_model(gguf_cfg)), fresh)
    assert _snapshots(gguf_cfg) == [] and not list(
        weight_snapshot.snapshot_path(gguf_cfg).parent.glob(".weights-*"))  # no temporary left


def test_only_the_most_recently_used_snapshots_are_kept(gguf_cfg, monkeypatch):
    get_model(gguf_cfg)
    [saved] = _snapshots(gguf_cfg)
    folder = saved.parent
    for i in range(4):  # snapshots of older keys, used longer ago
        old = folder / f"weights-{i:016x}-00000000.safetensors"
        old.write_bytes(b"x")
        os.utime(old, (1000 + i, 1000 + i))
    get_model(gguf_cfg)  # restores: the used one is now the newest
    bf16 = kiln_config_for(gguf_cfg.model_config.model_path, dtype="bfloat16",
                           tokenizer=str(gguf_cfg.model_config.tokenizer))
    get_model(bf16)  # saves a second key: the folder is pruned to the three newest
    left = sorted(p.name for p in folder.glob("weights-*.safetensors"))
    newest_old = "weights-0000000000000003-00000000.safetensors"
    assert len(left) == 3 and saved.name in left and newest_old in left


def test_no_snapshot_where_it_would_leave_the_disk_nearly_full(gguf_cfg, monkeypatch):
    import shutil

    fresh = _fresh(gguf_cfg, monkeypatch)
    tight = shutil.disk_usage("/")._replace(free=weight_snapshot._FREE_MARGIN)
    monkeypatch.setattr(weight_snapshot.shutil, "disk_usage", lambda _: tight)
    _assert_same(_state(get_model(gguf_cfg)), fresh)
    assert _snapshots(gguf_cfg) == []


@pytest.mark.parametrize("damage", ["crc", "header"])
def test_a_damaged_snapshot_that_cannot_be_removed_is_loaded_past(gguf_cfg, monkeypatch,
                                                                  kiln_logs, damage):
    """A read-only cache (EROFS, or another user's: EACCES): removing the damaged snapshot
    raised, and the model did not load."""
    import errno
    from pathlib import Path

    fresh = _fresh(gguf_cfg, monkeypatch)
    get_model(gguf_cfg)
    [saved] = _snapshots(gguf_cfg)
    data = bytearray(saved.read_bytes())
    if damage == "crc":  # one bit inside the weights: caught by the CRC, after restoring
        header = struct.unpack("<Q", data[:8])[0]
        data[8 + header + (len(data) - 8 - header) // 2] ^= 0x40
    else:  # caught while reading the header
        data = data[:-1000]
    saved.write_bytes(bytes(data))
    unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self.suffix == ".safetensors":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    _assert_same(_state(get_model(gguf_cfg)), fresh)
    assert "could not remove the unusable weight snapshot" in kiln_logs.text
    assert _snapshots(gguf_cfg) == [saved] and saved.read_bytes() == bytes(data)  # left alone


def test_an_unusable_snapshot_is_named_in_a_short_warning(gguf_cfg, monkeypatch, kiln_logs):
    """An error quoting the snapshot's header (its manifest: kilobytes) filled the log."""
    get_model(gguf_cfg)

    def fail(*_):
        raise ValueError("header: " + "x" * 3000)

    monkeypatch.setattr(weight_snapshot, "_assignments", fail)
    get_model(gguf_cfg)
    [warning] = {r.getMessage() for r in kiln_logs.records if " unusable (" in r.getMessage()}
    assert "ValueError: header: xxx" in warning and len(warning) < 600
