"""Inductor's cache directory is set around each compile and load only: the process's own
setting (or its absence) is back afterwards, whatever Inductor wrote meanwhile."""
import os

import pytest

from kiln.compilation.cache import INDUCTOR_CACHE_ENV, inductor_cache_at

POINTER = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


@pytest.mark.parametrize("before", [None, "/the/process/own"])
def test_set_within_restored_after(tmp_path, monkeypatch, before):
    if before is None:
        monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(INDUCTOR_CACHE_ENV, before)
    monkeypatch.delenv(POINTER, raising=False)
    with inductor_cache_at(tmp_path):
        assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path)
        os.environ[POINTER] = "1234"  # what Inductor does before loading a kernel library
    assert os.environ.get(INDUCTOR_CACHE_ENV) == before and POINTER not in os.environ


def test_none_leaves_the_directory_but_still_restores(monkeypatch):
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="compile failed"):
        with inductor_cache_at(None):
            assert INDUCTOR_CACHE_ENV not in os.environ
            os.environ[INDUCTOR_CACHE_ENV] = "/tmp/torchinductor_default"  # Inductor's own write
            raise RuntimeError("compile failed")
    assert INDUCTOR_CACHE_ENV not in os.environ
