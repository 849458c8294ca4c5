"""Shared fixtures for the native-kernel tests."""
import shutil

import pytest

from kiln import envs, ir
from kiln.ir import selection
from kiln.native import build, gguf_matmul, int4_linear, int8_ops


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty kernel cache and a cleared available() memo, with what is derived from it
    (the memos below, the IR ops' default bindings) put back after the test: a test that ran
    without the kernels must not leave later ones choosing as if there were none. The library
    this process loaded stays loaded: its ops register once per process."""
    bindings = {name: (op.provider, op.bound) for name, op in ir.REGISTRY.items()}
    applied = selection._applied
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv(build.INHERITED_LIBRARY_ENV, raising=False)  # a cache, not a parent's
    _clear_memos()
    yield tmp_path
    _clear_memos()
    for name, (provider, bound) in bindings.items():
        ir.REGISTRY[name].provider, ir.REGISTRY[name].bound = provider, bound
    selection._applied = applied


def _clear_memos() -> None:
    for memo in (build.available, int8_ops.isa, gguf_matmul.rows_worth_it,
                 int4_linear.kernel_available):
        memo.cache_clear()


@pytest.fixture
def cached_kernels(tmp_path, monkeypatch):
    """A cache root holding a copy of this checkout's library, built once in the machine's
    cache (a full build takes a minute on 2 cores); its path there."""
    cxx = build.compiler()
    built = build.build(cxx)  # the machine's cache: built once, reused
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv(build.INHERITED_LIBRARY_ENV, raising=False)
    target = build.library_path(cxx)
    target.parent.mkdir(parents=True)
    for path in (built, built.parent / (built.name + ".sha256")):
        shutil.copy2(path, target.parent / path.name)
    assert target.is_relative_to(tmp_path) and envs.cache_root() == tmp_path
    return target
