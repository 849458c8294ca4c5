"""Writing the compile cache when it fails or races: an unwritable cache or dump, a full disk, a
path with whitespace, concurrent writers, a compile that fails after its passes."""
import shutil
import subprocess
import sys
import types

import pytest
import torch
from _child import SIZES

from kiln.compilation.cache import CompileCache
from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.compiler_interface import InductorStandaloneAdaptor
from kiln.compilation.counters import compilation_counter
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm
from .toy_compiles import HERE, _run, _warm_model


def test_unwritable_cache_serves_without_it(cold, tmp_path, kiln_logs, monkeypatch):
    """A read-only or full cache directory (root cannot make one read-only here: the probe is
    made to fail) is a warning, then a compile as without a cache; never a crash."""
    import errno

    def read_only(self):
        raise OSError(errno.EROFS, "Read-only file system")

    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    monkeypatch.setattr(CompileCache, "check_writable", read_only)
    # The range shape alone: compiled in Inductor's usual cache, cold on a clean machine.
    model = _warm_model(cache, dict(num_saved_graph_loads=0, num_compiled_artifacts_loaded=0,
                                    num_compiled_artifacts_saved=0), compile_sizes=())
    assert "cannot be written" in kiln_logs.text and "KILN_CACHE_ROOT" in kiln_logs.text
    for n in (8, 3):
        torch.testing.assert_close(_run(model, n), _run(cold["reference"], n))


def test_a_full_disk_is_said_in_one_line(tmp_path):
    """A compile on a full disk ended in Inductor's C++ compile error, 2,000 lines with the
    linker's "No space left on device" in the middle (helper-25)."""
    from kiln.compilation.phase import WarmupPhase
    from kiln.compilation.piecewise import PieceCompiler

    class FullDisk:
        def compile(self, *args):
            raise RuntimeError("C++ compile error\n...\nld: final link failed: No space left "
                               "on device\n...")

    cache = CompileCache(tmp_path / "key", "rank_0", "backbone")
    cache.inductor_cache_dir.mkdir(parents=True)
    pieces = PieceCompiler(FullDisk(), cache, {}, WarmupPhase())
    with pytest.raises(RuntimeError, match=r"^compiling piece 3 failed: no space left on the "
                                           r"device holding the compile cache .*KILN_CACHE_ROOT"):
        pieces._compile_or_retry(3, None, [], None, None)


def test_a_cache_path_with_whitespace_is_refused_before_inductor_builds_there(tmp_path):
    """Inductor splits its C++ command line on whitespace: a KILN_CACHE_ROOT with a space failed
    every mode-3 compile with g++'s "input file is the same as output file" (helper-25)."""
    cache = CompileCache(tmp_path / "with space" / "key", "rank_0", "backbone")
    with pytest.raises(OSError, match="whitespace"):
        cache.check_writable()


def test_failed_save_and_unwritable_dump_still_serve(cold, tmp_path, kiln_logs, monkeypatch):
    """An artifact Inductor compiled but could not save (as with freezing), and a debug dump
    path that cannot be written: warnings, then a served model."""
    def cannot_save(artifact, save_path):
        raise RuntimeError("no aot_autograd artifacts to save")

    monkeypatch.setattr(InductorStandaloneAdaptor, "_save", staticmethod(cannot_save))
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    cache = tmp_path / "cache"
    # Inductor's own cache from the cold compile, none of Kiln's entries: Kiln compiles every
    # piece (and fails to save it), and Inductor serves the code from its cache, not from gcc.
    for inductor in (cold["root"] / "cache").glob("*/inductor_cache"):
        shutil.copytree(inductor, cache / inductor.parent.name / "inductor_cache")
    config = tm.toy_config(mode=3, cache_dir=str(cache),
                           debug_dump_path=str(not_a_dir / "dump"))
    model = tm.build(config)
    with compilation_counter.expect(num_compiled_artifacts_saved=0, num_inductor_compiles=3):
        with torch.no_grad():
            compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
    assert "could not be saved" in kiln_logs.text and "cannot be written" in kiln_logs.text
    for n in (8, 3):
        torch.testing.assert_close(_run(model, n), _run(cold["reference"], n))


def test_bookkeeping_it_cannot_write_is_a_warning_not_a_failed_start(tmp_path, kiln_logs):
    """A directory where index.json or split_graph.py goes (or a full disk, an immutable file)
    raised through Dynamo as BackendCompilerFailed, and the engine did not start (helper-37)."""
    cache = CompileCache(tmp_path, "rank_0", "ToyModel")
    cache.index_path.mkdir()
    (cache.dir / "split_graph.py").mkdir()
    handle = {"file": "a.bin", "fingerprint": "a"}
    cache.record(None, 0, "inductor_standalone", handle)
    cache.forget(None, 0, "inductor_standalone", "a")
    cache.write_text("split_graph.py", "graph")
    assert kiln_logs.text.count("compile cache: could not write") == 2
    assert str(cache.dir / "split_graph.py") in kiln_logs.text


def test_concurrent_index_writers_keep_every_entry(tmp_path):
    import multiprocessing as mp

    from _index_writer import record_many

    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(record_many, [(str(tmp_path), 0), (str(tmp_path), 1)])
    assert len(CompileCache(tmp_path, "rank_0", "M").index) == 40


@pytest.mark.slow
def test_two_processes_on_an_empty_cache_both_succeed(tmp_path):
    outs = [tmp_path / f"out{i}.pt" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "_child.py"), str(tmp_path / "cache"),
                               str(o)], cwd=HERE) for o in outs]
    assert [p.wait(timeout=500) for p in procs] == [0, 0]
    results = [torch.load(o) for o in outs]
    for n in SIZES:
        assert torch.equal(results[0]["outputs"][n], results[1]["outputs"][n])
    out = tmp_path / "warm.pt"
    subprocess.run([sys.executable, str(HERE / "_child.py"), str(tmp_path / "cache"), str(out)],
                   check=True, cwd=HERE, timeout=240)
    assert torch.load(out)["counters"]["num_inductor_compiles"] == 0


def test_debug_dump_names_each_unsaved_piece_apart(tmp_path):
    """With no compile cache (no save path) every piece of one shape still gets its own output
    code file: they were all named output_code_shape_None_0.py, the last one kept."""
    adaptor = InductorStandaloneAdaptor()
    adaptor.dump_dir = tmp_path / "dump"
    sources = []
    for i in range(3):
        src = tmp_path / f"module_{i}.py"
        src.write_text(f"# piece {i}\n")
        sources.append(types.SimpleNamespace(__file__=str(src)))
    for module in sources:
        adaptor._dump_output_code([module], None, None)
    dumped = sorted(f.read_text() for f in adaptor.dump_dir.glob("output_code_*.py"))
    assert dumped == [f"# piece {i}\n" for i in range(3)]


def test_a_compile_that_fails_after_its_passes_forgets_their_runs(monkeypatch):
    """Inductor raised past the passes (a TensorifyScalarRestartAnalysis that escaped
    standalone_compile): the failed attempt's runs stayed beside its retry's, and the per-pass
    match counts of a piece doubled."""
    import torch._inductor

    from kiln.compilation.compiler_interface import InductorStandaloneAdaptor
    from kiln.compilation.passes import pass_manager

    manager = pass_manager.PostGradPassManager()
    manager(torch.fx.Graph())  # an earlier piece's run stays
    kept = list(manager.runs)

    def passes_then_fail(graph, *args, **kwargs):
        manager(torch.fx.Graph())
        raise RuntimeError("restart analysis")

    monkeypatch.setattr(torch._inductor, "standalone_compile", passes_then_fail)
    with pytest.raises(RuntimeError, match="restart analysis"):
        InductorStandaloneAdaptor(manager).compile(torch.fx.GraphModule({}, torch.fx.Graph()),
                                                   [], {}, None)
    assert manager.runs == kept and pass_manager.RUNS[-1] is kept[-1]
