"""Shared fixtures for the native-kernel tests."""
import shutil

import pytest

from kiln import envs
from kiln.native import build


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty kernel cache and a cleared available() memo (restored after the test). The
    library this process loaded stays loaded: its ops register once per process."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    build.available.cache_clear()
    yield tmp_path
    build.available.cache_clear()


@pytest.fixture
def cached_kernels(tmp_path, monkeypatch):
    """A cache root holding a copy of this checkout's library, built once in the machine's
    cache (a full build takes a minute on 2 cores); its path there."""
    cxx = build.compiler()
    built = build.build(cxx)  # the machine's cache: built once, reused
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    target = build.library_path(cxx)
    target.parent.mkdir(parents=True)
    for path in (built, built.parent / (built.name + ".sha256")):
        shutil.copy2(path, target.parent / path.name)
    assert target.is_relative_to(tmp_path) and envs.cache_root() == tmp_path
    return target
