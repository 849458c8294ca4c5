"""torch_key() from Kiln's cache: reused while the package's sources keep their sizes and times,
recomputed when one changes or the record is damaged, and equal to torch's own."""
import os

from kiln.compilation import torch_source_key as tsk


def _package(root):
    (root / "sub").mkdir(parents=True)
    (root / "docs").mkdir()  # not a package: pkgutil (so torch_key) never reads it
    for path in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "docs/c.py"):
        (root / path).write_text(f"# {path}\n")
    return root


def test_signature_follows_sizes_times_and_files_of_packages_only(tmp_path):
    root = _package(tmp_path / "pkg")
    first = tsk.source_signature(root, "1.0")
    assert tsk.source_signature(root, "1.0") == first
    assert tsk.source_signature(root, "1.1") != first
    (root / "docs" / "c.py").write_text("# not read by torch_key, longer\n")
    assert tsk.source_signature(root, "1.0") == first
    b = root / "sub" / "b.py"
    stat = b.stat()
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    touched = tsk.source_signature(root, "1.0")
    assert touched != first
    (root / "sub" / "new.py").write_text("")
    assert tsk.source_signature(root, "1.0") != touched


def test_cached_key_computes_once_per_signature_and_survives_damage(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return bytes([len(calls)])

    record = tmp_path / "key.json"
    assert tsk.cached_key(compute, "sig", record) == b"\x01"
    assert tsk.cached_key(compute, "sig", record) == b"\x01" and len(calls) == 1
    assert tsk.cached_key(compute, "other", record) == b"\x02"
    record.write_text('{"signature": "other", "key": "zz"}')  # damaged: recomputed
    assert tsk.cached_key(compute, "other", record) == b"\x03"


def test_torch_source_key_is_torch_key(tmp_path, monkeypatch):
    from torch._inductor import codecache

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(tsk, "_memo", {})
    truth = codecache.torch_key()
    assert tsk.torch_source_key() == truth  # computed (already memoized here): recorded
    assert list((tmp_path / "torch_source_key").glob("*.json"))
    if hasattr(codecache.torch_key, "clear"):  # torch 2.13: a fresh process's memo, from disk
        codecache.torch_key.clear()
        monkeypatch.setattr(tsk, "_memo", {})
        monkeypatch.setattr(tsk, "cached_key", lambda compute, sig, path: truth)
        assert tsk.torch_source_key() == truth and codecache.torch_key() == truth
        monkeypatch.setattr(tsk, "cached_key", None)  # a second call reads neither disk nor torch
        assert tsk.torch_source_key() == truth
