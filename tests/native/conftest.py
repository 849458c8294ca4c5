"""Shared fixtures for the native-kernel tests."""
import pytest

from kiln.native import build


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty kernel cache and a cleared load() memo (restored after the test)."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    build.load.cache_clear()
    yield tmp_path
    build.load.cache_clear()
