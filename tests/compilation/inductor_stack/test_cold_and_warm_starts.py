"""Mode 3 on Inductor: the cold compile's counts, shape dispatch, the cache's layout, and warm
starts (in a second process, in process from the saved graph, a size missing)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _child import SIZES

from kiln.compilation.backend import KilnBackend
from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.compiler_interface import InductorStandaloneAdaptor, file_sha256
from kiln.compilation.counters import compilation_counter
from kiln.compilation.phase import RecompileAfterWarmupError

import toy_model as tm
from .toy_compiles import HERE, _run, _warm_model


def test_cold_compile_counts(cold):
    d = cold["deltas"]
    assert d["num_graphs_seen"] == 1
    assert d["num_piecewise_graphs_seen"] == 5 and d["num_piecewise_capturable_graphs_seen"] == 3
    assert d["num_inductor_compiles"] == 9  # 3 distinct pieces x (range, 1, 8)
    assert d["num_compiled_artifacts_saved"] == 9 and d["num_compiled_artifacts_loaded"] == 0


def test_exact_size_wins_else_range(cold):
    model, reference = cold["model"], cold["reference"]
    pieces = model._kiln_compile.backend.pieces.values()
    assert compile_state_of(model).warmup_phase.serving
    for n, label in [(1, 1), (8, 8), (3, "range"), (64, "range")]:
        before = [p.dispatch_counts[label] for p in pieces]
        with compilation_counter.expect(num_inductor_compiles=0, num_graphs_seen=0):
            torch.testing.assert_close(_run(model, n), _run(reference, n))
        assert [p.dispatch_counts[label] - b for p, b in zip(pieces, before)] == [1, 1, 1]


def test_cache_layout_and_debug_dump(cold):
    backend: KilnBackend = cold["model"]._kiln_compile.backend
    cache_dir = Path(backend.cache.dir)
    assert cache_dir == cold["root"] / "cache" / backend.cache_key / "rank_0" / "ToyModel"
    assert (cache_dir / "split_graph.py").read_text().count("submod_") >= 5
    assert len(backend.cache.index) == 9 and len(list((cache_dir / "artifacts").iterdir())) == 9
    assert any(p.name.endswith("toy_model.py") for p in map(Path, backend.traced))
    assert (cache_dir.parent.parent / "inductor_cache").is_dir()
    dump = cold["root"] / "dump" / "rank_0" / "ToyModel"
    assert (dump / "split_graph.py").exists() and len(list(dump.glob("piece_*.py"))) == 5
    codes = [f.read_text() for f in dump.glob("output_code_*.py")]
    assert codes
    # The CPU platform's Inductor defaults: no per-call input checks in the compiled code.
    assert not any("assert_size_stride(" in c or "assert_alignment(" in c for c in codes)


def test_platform_inductor_defaults_hash_and_yield_to_the_user():
    cpu, cuda = InductorStandaloneAdaptor(device="cpu"), InductorStandaloneAdaptor(device="cuda")
    assert cpu.defaults["size_asserts"] is False and cuda.defaults == {}
    assert cpu.compute_hash() != cuda.compute_hash()
    assert cpu.config_patches({"size_asserts": True, "max_autotune": False}) == {
        "size_asserts": True, "alignment_asserts": False, "scalar_asserts": False,
        "max_autotune": False}
    cpu.defaults["no_such_inductor_option"] = 1  # an option an older torch lacks is skipped
    assert "no_such_inductor_option" not in cpu.config_patches({})


def test_warm_start_in_second_process_compiles_nothing(cold, tmp_path):
    out, tmp = tmp_path / "out.pt", tmp_path / "tmp"
    tmp.mkdir()
    # A fresh temp dir, as after a reboot or in a new container: Inductor keeps its precompiled
    # headers there, outside Kiln's cache, and must not rebuild one to load built libraries.
    env = {**os.environ, "TMPDIR": str(tmp)}
    subprocess.run([sys.executable, str(HERE / "_child.py"), str(cold["root"] / "cache"),
                    str(out)], check=True, cwd=HERE, timeout=240, env=env)
    result = torch.load(out)
    c = result["counters"]
    assert c["num_inductor_compiles"] == 0 and c["num_compiled_artifacts_loaded"] == 9
    assert result["cpp_builds"] == []  # no C++ compiler run, not even the preprocessor
    # The saved graph replaced Dynamo: nothing traced, no graph handed to the backend.
    assert c["num_dynamo_traces"] == 0 and c["num_graphs_seen"] == 0
    assert c["num_saved_graph_loads"] == 1
    for n in SIZES:
        assert torch.equal(result["outputs"][n], _run(cold["model"], n))


def test_artifacts_load_under_the_inductor_options_they_were_compiled_with(simdlen_children):
    """inductor_compile_config {"cpp.simdlen": 256} on an AVX-512 machine: Inductor writes AVX2
    kernels. Loading an artifact (right after saving it, and at a warm start) built them again
    under the process's own options, for AVX-512 vectors: the first forward corrupted the heap
    (glibc abort). Both processes must serve the eager model's outputs, the warm one building
    nothing. One layer and the range shape alone: each compiled artifact is loaded back the same
    way, and the child's cold compile is 2 pieces where 2 layers and sizes 1 and 8 made it 9."""
    eager = tm.build(tm.toy_config(mode=0, num_layers=1))
    reference = {n: _run(eager, n) for n in SIZES}
    runs = simdlen_children.result()
    assert [run for run, *_ in runs] == ["cold", "warm"], runs[-1][2][-2000:]
    for run, returncode, stderr, out in runs:
        assert returncode == 0, f"{run} start: {stderr[-2000:]}"
        result = torch.load(out)
        for n in SIZES:
            torch.testing.assert_close(result["outputs"][n], reference[n])
    assert result["counters"]["num_inductor_compiles"] == 0 and result["cpp_builds"] == []


def test_saved_graph_warm_start_in_process_matches_cold(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    kiln_logs.set_level("INFO", logger="kiln")
    model = _warm_model(cache, dict(num_dynamo_traces=0, num_saved_graph_loads=1,
                                    num_inductor_compiles=0, num_graphs_seen=0))
    # One line per shape with its load time (3 distinct pieces each).
    for shape in ("range", "size 1", "size 8"):
        assert re.search(rf"shape {shape}: 0 compiled in 0.00 s, 3 loaded in \d+\.\d\d s",
                         kiln_logs.text), shape
    assert sorted(model._kiln_compile.backend.pieces) == [0, 2, 4]
    for n in (64, 8, 3, 1):
        assert torch.equal(_run(model, n), _run(cold["model"], n))
    with pytest.raises(RecompileAfterWarmupError, match="traced for inputs"):
        model(tm.inputs(4)[0].int(), tm.inputs(4)[1])


def _module_calls_of_splitting_pieces(model, n: int) -> tuple[int, int]:
    """(splitting-op pieces, calls that went through their nn.Module.__call__) in one forward."""
    calls = []
    items = [it for it in model._kiln_compile.backend.split_items if it.is_splitting_graph]
    handles = [it.graph.register_forward_pre_hook(lambda m, a: calls.append(m)) for it in items]
    try:
        _run(model, n)
    finally:
        for handle in handles:
            handle.remove()
    return len(items), len(calls)


def test_splitting_pieces_skip_module_call_cold_and_warm(cold, tmp_path):
    assert _module_calls_of_splitting_pieces(cold["model"], 3) == (2, 0)
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    warm = _warm_model(cache, dict(num_saved_graph_loads=1, num_inductor_compiles=0))
    assert _module_calls_of_splitting_pieces(warm, 3) == (2, 0)
    assert torch.equal(_run(warm, 3), _run(cold["model"], 3))


def test_warm_start_missing_a_size_artifact_traces_and_compiles_it(cold, tmp_path, kiln_logs):
    # A saved graph is code-only and never compiled: a damaged size artifact, or a compile size
    # added since the cold start, sends the warm start back to Dynamo, which compiles just those.
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    artifact = sorted(cache.glob("*/rank_0/ToyModel/artifacts/*_8_*.bin"))[0]
    artifact.write_bytes(artifact.read_bytes()[:100])
    kiln_logs.set_level("INFO", logger="kiln")
    model = _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                                    num_corrupt_artifacts=1, num_inductor_compiles=1 + 3,
                                    num_compiled_artifacts_loaded=8), compile_sizes=(1, 8, 4))
    assert "{shape: pieces} {4: [0, 2, 4], 8: [0]}" in kiln_logs.text
    for n in (8, 4, 3):
        torch.testing.assert_close(_run(model, n), _run(cold["reference"], n))


def test_warm_start_checks_each_artifact_file_once(cold, monkeypatch):
    from kiln.compilation.warm_start import graph_cache, warm_start

    backend: KilnBackend = cold["model"]._kiln_compile.backend
    plan, _ = graph_cache.load_plan(backend.cache)
    hashed = []
    monkeypatch.setattr(warm_start, "file_sha256",
                        lambda path: hashed.append(path.name) or file_sha256(path))
    # Listed twice, as identical layers sharing artifact files are in a real model.
    assert warm_start.missing_artifacts(backend.cache, backend.compiler, plan.pieces * 2,
                                        [1, 8]) == {}
    assert sorted(hashed) == sorted({p.name for p in backend.cache.dir.glob("artifacts/*.bin")})
    assert warm_start.missing_artifacts(backend.cache, backend.compiler, plan.pieces, [2]) == {
        2: [0, 2, 4]}  # a size never compiled
