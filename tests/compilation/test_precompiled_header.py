"""Loads hand Inductor the plain kernel header: no preprocessor run, no 156 MB `.gch` build."""
from pathlib import Path

from torch._inductor import codecache

from kiln.compilation.precompiled_header import headers_not_precompiled, plain_header_path

HEADER = "torch/csrc/inductor/cpp_prefix.h"


def test_lookup_returns_the_shipped_header_inside_the_block_only():
    real = codecache._precompile_header
    with headers_not_precompiled():
        path = codecache._precompile_header(HEADER, "g++ -O3 ...", device_type="cpu")
    assert path == plain_header_path(HEADER) and Path(path).read_text().strip()
    assert path.endswith(HEADER) and codecache._precompile_header is real


def test_unknown_header_falls_back_to_inductor(monkeypatch):
    calls = []
    monkeypatch.setattr(codecache, "_precompile_header", lambda *a, **k: calls.append(a) or "x.h")
    with headers_not_precompiled():
        assert codecache._precompile_header("no/such/header.h", "cmd") == "x.h"
    assert calls == [("no/such/header.h", "cmd")]
