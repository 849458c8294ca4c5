"""Building the CPU kernels: one library, cached by key and reused, and a clean fallback to the
torch code (one warning, nothing else changes) when no compiler is there or the build fails."""
import logging
import os
import shutil

import pytest
import torch

from kiln import ir
from kiln.native import build, gemv, paged_attention

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")


@needs_compiler
def test_a_built_library_is_reused(cached_kernels):
    cxx = build.compiler()
    mtime = cached_kernels.stat().st_mtime_ns
    assert build.build(cxx) == cached_kernels and cached_kernels.stat().st_mtime_ns == mtime
    assert build.intact(cached_kernels)


@needs_compiler
def test_a_child_loads_its_parents_library_under_another_cache_root(monkeypatch, tmp_path):
    """An engine core or rank started with another KILN_CACHE_ROOT (tests set one for their GGUF
    caches) compiled the whole library again: minutes on 2 cores, per process."""
    cxx = build.compiler()
    built = build.build(cxx)
    assert build.available() and os.environ[build.INHERITED_LIBRARY_ENV] == str(build._loaded)
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv(build.INHERITED_LIBRARY_ENV, str(built))
    assert build.build(cxx) == built and not (tmp_path / "kernels").exists()
    stale = tmp_path / "another-key" / built.name  # another build's library: not this one
    stale.parent.mkdir()
    shutil.copyfile(built, stale)
    shutil.copyfile(build._checksum_file(built), build._checksum_file(stale))
    monkeypatch.setenv(build.INHERITED_LIBRARY_ENV, str(stale))
    assert build.inherited_library(cxx) is None


@needs_compiler
def test_a_parents_library_with_a_garbage_checksum_is_not_loaded(monkeypatch, tmp_path):
    """A checksum file of non-UTF-8 bytes beside the library a parent named (or in the
    cache) killed the engine core with UnicodeDecodeError; it is a mismatch like any other,
    and the child loads its own cache's copy instead."""
    cxx = build.compiler()
    built = build.build(cxx)
    damaged = tmp_path / built.parent.name / built.name  # this build's key, a bad checksum
    damaged.parent.mkdir()
    shutil.copyfile(built, damaged)
    build._checksum_file(damaged).write_bytes(b"\xff\xfe" + b"\x00" * 8)
    assert not build.intact(damaged)
    monkeypatch.setenv(build.INHERITED_LIBRARY_ENV, str(damaged))
    assert build.inherited_library(cxx) is None and build.build(cxx) == built


@needs_compiler
def test_the_key_follows_sources_flags_and_compiler(monkeypatch, tmp_path):
    cxx = build.compiler()
    key = build.build_key(cxx)
    monkeypatch.setattr(build, "CFLAGS", [*build.CFLAGS, "-DKILN_TEST"])
    assert build.build_key(cxx) != key
    monkeypatch.undo()
    other = tmp_path / "c++"  # another compiler (its --version differs)
    other.write_text("#!/bin/sh\necho 'another compiler 1.0'\n")
    other.chmod(0o755)
    assert build.build_key(str(other)) != key


def test_one_library_holds_every_kernel():
    # every source of csrc/ goes into the one build: C kernels and C++ ops alike
    names = {p.name for p in build.sources()}
    assert {"gemv.c", "layer_ops.c", "paged_attention.c", "gguf_matmul.c", "gguf_layout.c",
            "int8_ops.c", "linear_op.cpp", "attention_op.cpp", "ops_layer.cpp",
            "ops_int8.cpp", "ops_gguf.cpp"} <= names
    # -ffast-math compiles the kernels but never reaches the link (crtfastmath.o)
    assert "-ffast-math" in build.CFLAGS and "-ffast-math" not in build.LDFLAGS


def test_no_compiler_falls_back_to_torch(fresh_kernels, monkeypatch, caplog):
    monkeypatch.delenv("KILN_REQUIRE_NATIVE", raising=False)  # CI sets it; the fall-back is tested
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.delenv("KILN_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not paged_attention.available()
        chosen = ir.resolve({}, "cpu", torch.float32).as_dict()
        for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                   "linear", "gguf_linear", "unified_attention"):
            assert chosen[op] == "torch", op
        assert not gemv.serves(torch.randn(4, 8), None)
    assert caplog.text.count("no C++ compiler found (set CXX or install g++)") == 1


def test_require_native_makes_a_missing_compiler_an_error(fresh_kernels, monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setenv("KILN_REQUIRE_NATIVE", "1")
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found .*KILN_REQUIRE_NATIVE=1"):
        build.available()


def test_failed_build_falls_back_with_the_compiler_error(fresh_kernels, monkeypatch, caplog,
                                                         tmp_path):
    monkeypatch.delenv("KILN_REQUIRE_NATIVE", raising=False)  # CI sets it; the fall-back is tested
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\n"  # a compiler that runs, and fails every compile
                      "case \"$1\" in --version|-v) echo 'g++ (GCC) 12.2.0'; exit 0;; esac\n"
                      "echo 'c++: error: no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert not build.available()
        assert not gemv.available()  # asked again: the same verdict, no second warning
    assert caplog.text.count("could not build Kiln's CPU kernels") == 1
    assert "no such flag" in caplog.text


@needs_compiler
def test_native_cflags_build_a_lower_cpus_kernels_under_a_key_of_their_own(monkeypatch):
    """KILN_NATIVE_CFLAGS (the ISA tier tests' and kiln.benchmarks.moe's way to run a CPU
    without AMX on one with it) follow -march=native and change the library's key."""
    cxx = build.compiler()
    monkeypatch.delenv("KILN_NATIVE_CFLAGS", raising=False)
    native = build.build_key(cxx)
    assert build.cflags() == build.CFLAGS
    monkeypatch.setenv("KILN_NATIVE_CFLAGS", " -mno-amx-tile  -mno-amx-bf16 ")
    assert build.cflags() == [*build.CFLAGS, "-mno-amx-tile", "-mno-amx-bf16"]
    assert build.build_key(cxx) != native
