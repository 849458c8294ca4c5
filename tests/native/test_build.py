"""Building the C kernels: cached by key, rebuilt when the key changes, and a clean fallback to
the torch code (one warning, nothing else changes) when no compiler is there."""
import logging
import threading

import pytest
import torch

from kiln import ir
from kiln.native import build, gemv, paged_attention


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_build_once_then_reuse(fresh_kernels):
    cc = build.compiler()
    first = build.build("gemv", cc)
    assert first.is_relative_to(fresh_kernels / "kernels") and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.build("gemv", cc) == first and first.stat().st_mtime_ns == mtime
    assert build.build_key("gemv", cc) != build.build_key("layer_ops", cc)
    # No half-written build (mkstemp's tmp*.so) left beside the library and its checksum.
    assert sorted(p.name for p in first.parent.iterdir()) == [
        ".lock", first.name, first.name + ".sha256"]
    assert build.intact(first)


def test_no_compiler_falls_back_to_torch(fresh_kernels, monkeypatch, caplog):
    monkeypatch.delenv("KILN_REQUIRE_NATIVE", raising=False)  # CI sets it; the fall-back is tested
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.delenv("KILN_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not paged_attention.available()
        chosen = ir.resolve({}, "cpu", torch.float32).as_dict()
        for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                   "unified_attention"):
            assert chosen[op] == "torch", op
        assert not gemv.serves(torch.randn(4, 8), None)
    assert "no C compiler found (set CC or install gcc)" in caplog.text


def test_require_native_makes_a_missing_compiler_an_error(fresh_kernels, monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(build, "cxx_compiler", lambda: None)
    monkeypatch.setenv("KILN_REQUIRE_NATIVE", "1")
    with pytest.raises(RuntimeError, match=r"no C compiler found .*KILN_REQUIRE_NATIVE=1"):
        build.load("gemv", ())
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found .*KILN_REQUIRE_NATIVE=1"):
        build.load_torch_op.__wrapped__("linear_op")


def test_failed_build_falls_back_with_the_compiler_error(fresh_kernels, monkeypatch, caplog,
                                                         tmp_path):
    monkeypatch.delenv("KILN_REQUIRE_NATIVE", raising=False)  # CI sets it; the fall-back is tested
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not gemv.available()
    assert "could not build the CPU kernels gemv" in caplog.text
    assert "no such flag" in caplog.text


def test_cpp_op_without_a_working_cxx_compiler_is_off_with_a_warning(fresh_kernels, monkeypatch,
                                                                   caplog, tmp_path):
    monkeypatch.delenv("KILN_REQUIRE_NATIVE", raising=False)  # CI sets it; the fall-back is tested
    load = build.load_torch_op.__wrapped__  # uncached: the real op stays loaded in this process
    monkeypatch.setattr(build, "cxx_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not load("linear_op")
    assert "no C++ compiler found (set CXX or install g++)" in caplog.text
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\necho 'c++: error: no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(build, "cxx_compiler", lambda: str(broken))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not load("linear_op")
    assert "could not build the C++ op linear_op" in caplog.text and "no such flag" in caplog.text


def test_cpp_op_builds_run_at_once_and_each_only_once(fresh_kernels, monkeypatch):
    ops = sorted(p.stem for p in build.CSRC.glob("*.cpp"))
    assert len(ops) >= 2
    barrier, calls = threading.Barrier(len(ops)), []

    def fake_build(name, cc, cpp=False):
        calls.append(name)
        barrier.wait(timeout=10)  # returns only once every op's build is running
        return fresh_kernels / f"{name}.so"

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(build, "_torch_op_builds", {})
    assert build._torch_op_library(ops[0], "c++") == fresh_kernels / f"{ops[0]}.so"
    assert build._torch_op_library(ops[1], "c++") == fresh_kernels / f"{ops[1]}.so"
    assert sorted(calls) == ops
