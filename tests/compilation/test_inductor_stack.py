"""Mode 3 on Inductor: shape dispatch, disk cache (warm start in a second process, key, corrupt
artifacts, concurrent writers), debug dumps. One cold compile is shared by the module."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _child import SIZES

from kiln import envs
from kiln.compilation.backend import KilnBackend
from kiln.compilation.cache import CompileCache, cache_base_dir, compute_cache_key, index_key
from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.compiler_interface import InductorStandaloneAdaptor, file_sha256
from kiln.compilation.counters import compilation_counter
from kiln.compilation.phase import RecompileAfterWarmupError
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _own_cache_root(tmp_path_factory):
    """A Kiln cache root of this module's own (children inherit it): the machine's one is shared
    with every other process, whose kernel builds and vector-ISA verdict writes feed the compile
    cache key. Seeded with a snapshot of the machine's builds, to spare the compiles."""
    root = tmp_path_factory.mktemp("kiln_cache_root")
    for name in ("kernels", "inductor_vec_isa"):
        if (envs.cache_root() / name).is_dir():
            shutil.copytree(envs.cache_root() / name, root / name,
                            ignore=shutil.ignore_patterns(".lock", "*.tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_ROOT", str(root))
        yield root


def _simdlen_children(cache: Path, env: dict) -> list:
    """test_artifacts_load_under_the_inductor_options_they_were_compiled_with's two starts on
    one cache, cold then warm: [(run, returncode, stderr, out path)]."""
    more = json.dumps({"inductor_compile_config": {"cpp.simdlen": 256}, "compile_sizes": [],
                       "num_layers": 1})
    runs = []
    for run in ("cold", "warm"):
        out = cache.parent / f"{run}.pt"
        child = subprocess.run([sys.executable, str(HERE / "_child.py"), str(cache), str(out),
                                more], cwd=HERE, timeout=300, capture_output=True, text=True,
                               env=env)
        runs.append((run, child.returncode, child.stderr, out))
        if child.returncode:
            break
    return runs


@pytest.fixture(scope="module")
def simdlen_children(_own_cache_root, tmp_path_factory):
    """Started with the module: the two children run while this process compiles `cold` (the
    suite's machine has two cores). The environment as now, before any test changes it."""
    env = {k: v for k, v in os.environ.items() if k != "KILN_DISABLE_COMPILE_CACHE"}
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_simdlen_children, tmp_path_factory.mktemp("simdlen") / "cache", env)


@pytest.fixture(scope="module")
def cold(tmp_path_factory, simdlen_children):
    """Cold-compile the toy model (range + sizes 1 and 8) into an empty cache (the simdlen
    children started first, to run meanwhile)."""
    os.environ.pop("KILN_DISABLE_COMPILE_CACHE", None)
    root = tmp_path_factory.mktemp("compile")
    config = tm.toy_config(mode=3, compile_sizes=[1, 8], cache_dir=str(root / "cache"),
                           debug_dump_path=str(root / "dump"))
    model = tm.build(config)
    before = compilation_counter.clone()
    with torch.no_grad():
        compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                            compile_state_of(model).warmup_phase)
    deltas = {k: getattr(compilation_counter, k) - getattr(before, k) for k in vars(before)}
    return {"root": root, "config": config, "model": model, "deltas": deltas,
            "reference": tm.build(tm.toy_config(mode=0))}


def _run(model, n):
    with torch.no_grad():
        return model(*tm.inputs(n))


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


def _warm_model(cache: Path, deltas: dict, compile_sizes=(1, 8), **config_args):
    config = tm.toy_config(mode=3, compile_sizes=list(compile_sizes), cache_dir=str(cache),
                           **config_args)
    model = tm.build(config)
    with compilation_counter.expect(**deltas):
        with torch.no_grad():
            compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
    return model


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


def test_corrupt_saved_graph_warns_and_traces(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    saved = next(cache.glob("*/rank_0/ToyModel/saved_graph.pkl"))
    saved.write_bytes(saved.read_bytes()[:50])
    model = _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                                    num_inductor_compiles=0, num_compiled_artifacts_loaded=9))
    assert "saved graph" in kiln_logs.text and "failed to load" in kiln_logs.text
    for n in (8, 3):
        assert torch.equal(_run(model, n), _run(cold["model"], n))


def test_warm_start_with_debug_dump_traces_and_dumps(cold, tmp_path):
    cache, dump = tmp_path / "cache", tmp_path / "dump"
    shutil.copytree(cold["root"] / "cache", cache)
    _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0, num_inductor_compiles=0,
                            num_compiled_artifacts_loaded=9), debug_dump_path=str(dump))
    out = dump / "rank_0" / "ToyModel"
    assert (out / "split_graph.py").exists() and len(list(out.glob("piece_*.py"))) == 5
    assert list(out.glob("output_code_*.py"))  # the loaded artifacts' code


def test_edited_saved_graph_plan_warns_and_traces(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    plan = next(cache.glob("*/rank_0/ToyModel/saved_graph.json"))
    data = json.loads(plan.read_text())
    data["output"] = 7  # no such graph output: it would fail at every first forward
    plan.write_text(json.dumps(data))
    model = _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                                    num_inductor_compiles=0))
    assert "does not match its recorded checksum" in kiln_logs.text
    assert torch.equal(_run(model, 3), _run(cold["model"], 3))


def test_stale_saved_graph_entry_traces(cold, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    entry = next((cache / "saved_graphs").glob("*.json"))
    source = tmp_path / "changed.py"
    source.write_text("x = 1\n")  # a traced file whose contents no longer match the key
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "traced_files": data["traced_files"] + [str(source)]}))
    _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                            num_inductor_compiles=0))


def test_cache_key_follows_config_source_and_compiler(cold, tmp_path):
    backend: KilnBackend = cold["model"]._kiln_compile.backend
    files = list(backend.traced)
    assert backend.key_for(files) == backend.cache_key
    other = KilnBackend(tm.toy_config(mode=3, max_num_batched_tokens=128), "ToyModel")
    assert other.key_for(files) != backend.cache_key
    same = KilnBackend(tm.toy_config(mode=3, compile_sizes=[2]), "ToyModel")
    assert same.key_for(files) == backend.cache_key  # compile sizes only add artifacts
    source = tmp_path / "model.py"
    source.write_text("x = 1\n")
    key = compute_cache_key("cfg", [str(source)], "compiler", "cpu")
    source.write_text("x = 2\n")
    assert compute_cache_key("cfg", [str(source)], "compiler", "cpu") != key
    assert compute_cache_key("cfg", [str(source)], "other", "cpu") != key


def test_another_checkout_sharing_the_cache_has_its_own_keys(monkeypatch, tmp_path):
    """A saved trace lists its traced files by absolute path: another checkout's start would
    hash the first one's files, unchanged, and load its code. The checkout is in the key."""
    from kiln.compilation import cache

    source = tmp_path / "model.py"
    source.write_text("x = 1\n")
    key = compute_cache_key("cfg", [str(source)], "compiler", "cpu")
    monkeypatch.setattr(cache, "KILN_ROOT", str(tmp_path / "other_checkout" / "kiln"))
    assert compute_cache_key("cfg", [str(source)], "compiler", "cpu") != key


def test_an_edit_to_the_compile_stack_changes_the_key(monkeypatch, tmp_path):
    """Splitting, piecewise assembly and the saved-graph format are no traced file: a checkout's
    edit there loaded the artifacts the old code had made."""
    from kiln.compilation import cache

    key = compute_cache_key("cfg", [], "compiler", "cpu")
    monkeypatch.setattr(cache, "stack_code_hash", lambda: "edited")
    assert compute_cache_key("cfg", [], "compiler", "cpu") != key
    assert "split.py" in str(sorted((Path(cache.KILN_ROOT) / "compilation").glob("*.py")))
    assert cache.STACK_CODE_DIRS == ("compilation", "compilation/warm_start")
    (tmp_path / "compilation").mkdir()
    (tmp_path / "compilation" / "split.py").write_text("x = 1\n")
    before = cache.code_hash(tmp_path, ("compilation",))
    (tmp_path / "compilation" / "split.py").write_text("x = 2\n")
    assert cache.code_hash(tmp_path, ("compilation",)) != before


def test_the_ir_and_pass_sources_are_in_the_pass_managers_uuid(tmp_path, monkeypatch):
    """What lowering puts in a graph (an IR op's reference) is no traced file: an edit there
    must change the uuid that keys Inductor's cache and Kiln's."""
    from kiln.compilation.passes import pass_manager
    from kiln.compilation.passes.pass_manager import GRAPH_CODE_DIRS, graph_code_hash

    for directory in GRAPH_CODE_DIRS:
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / "a.py").write_text("x = 1\n")
    before = graph_code_hash(tmp_path)
    (tmp_path / "ir" / "a.py").write_text("x = 2\n")
    assert graph_code_hash.__wrapped__(tmp_path) != before
    manager = pass_manager.PostGradPassManager()
    uuid = manager.uuid()
    monkeypatch.setattr(pass_manager, "graph_code_hash", lambda: "edited")
    assert manager.uuid() != uuid


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    assert cache_base_dir("") == tmp_path / "torch_compile_cache"
    assert cache_base_dir(str(tmp_path / "x")) == tmp_path / "x"


def test_corrupt_artifact_warns_recompiles_and_serves(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    artifacts = sorted(cache.glob("*/rank_0/ToyModel/artifacts/*_range_*.bin"))
    artifacts[0].write_bytes(artifacts[0].read_bytes()[:100])  # truncated
    config = tm.toy_config(mode=3, compile_sizes=[1, 8], cache_dir=str(cache))
    model = tm.build(config)
    with compilation_counter.expect(num_corrupt_artifacts=1, num_inductor_compiles=1,
                                    num_cache_misses=1, num_compiled_artifacts_loaded=8):
        with torch.no_grad():
            compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
    assert "failed to load" in kiln_logs.text
    for n in (3, 1):
        torch.testing.assert_close(_run(model, n), _run(cold["reference"], n))


def test_deleted_artifact_is_a_miss_not_damage(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    sorted(cache.glob("*/rank_0/ToyModel/artifacts/*_1_*.bin"))[0].unlink()
    _warm_model(cache, dict(num_corrupt_artifacts=0, num_cache_misses=1, num_inductor_compiles=1,
                            num_compiled_artifacts_loaded=8))
    assert "is missing; recompiling it" in kiln_logs.text and "failed to load" not in kiln_logs.text


def test_forgotten_entry_stays_forgotten_on_disk(tmp_path):
    def entry(name):
        return {"file": name, "fingerprint": "f"}

    cache = CompileCache(tmp_path, "rank_0", "M")
    cache.record(1, 0, "c", entry("damaged"))
    cache.record(1, 1, "c", entry("good"))
    cache.forget(1, 0, "c", "f")
    other = CompileCache(tmp_path, "rank_0", "M")  # another process, or this one's next record
    other.record(2, 0, "c", entry("new"))
    assert other.lookup(1, 0, "c", "f") is None and other.lookup(1, 1, "c", "f") == entry("good")
    cache.record(8, 0, "c", entry("later"))  # a merge must not bring it back either
    assert cache.lookup(1, 0, "c", "f") is None
    # An entry another process wrote anew after the damage is not ours to drop.
    other.record(1, 0, "c", entry("recompiled"))
    cache.index[index_key(1, 0, "c", "f")] = entry("damaged")
    cache.forget(1, 0, "c", "f")
    assert CompileCache(tmp_path, "rank_0", "M").lookup(1, 0, "c", "f") == entry("recompiled")


def test_disabled_cache_reuses_nothing_from_inductor_cache(cold, monkeypatch):
    """With KILN_DISABLE_COMPILE_CACHE, Inductor's own cache must not serve what an earlier
    compile (here the cold one, in Kiln's cache) left behind."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    earlier = str(next((cold["root"] / "cache").glob("*/inductor_cache")))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", earlier)
    config = tm.toy_config(mode=3, cache_dir=str(cold["root"] / "cache"))
    model = tm.build(config)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with compilation_counter.expect(num_inductor_compiles=3, num_compiled_artifacts_loaded=0):
        with torch.no_grad():
            compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
    assert counters["inductor"]["fxgraph_cache_hit"] == hits
    private = model._kiln_compile.backend.inductor_dir
    assert private.name.startswith("kiln_inductor_") and any(private.iterdir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == earlier  # the process's setting, restored
    torch.testing.assert_close(_run(model, 3), _run(cold["reference"], 3))


def test_damaged_inductor_cache_is_cleared_and_compiled_again(cold, tmp_path):
    """Inductor's own cache under the key held truncated .so files: in a fresh process the
    artifacts fail to load and compiling them again reads the same files, so the recompile
    must start that cache afresh (a second process: this one has the libraries loaded)."""
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    libraries = list(cache.glob("*/inductor_cache/**/*.so"))
    assert libraries
    # Dated ahead: a cut file younger than drop_cut_libraries' settling time is left alone (it
    # may be being written), so the load fails whenever the child starts, also on a machine
    # slow enough that it would have started past that time (the files then dropped instead).
    ahead = time.time() + 3600
    for lib in libraries:
        lib.write_bytes(lib.read_bytes()[:64])
        os.utime(lib, (ahead, ahead))
    # The range shape alone (the key leaves compile sizes out): its three artifacts fail to
    # load as the sizes' would, and the recompile after clearing is three pieces, not nine.
    range_only = json.dumps({"compile_sizes": []})
    for run in ("damaged", "after"):
        out = tmp_path / f"{run}.pt"
        child = subprocess.run([sys.executable, str(HERE / "_child.py"), str(cache), str(out),
                                range_only], cwd=HERE, timeout=400, capture_output=True,
                               text=True)
        assert child.returncode == 0, child.stderr[-3000:]
        result = torch.load(out)
        for n in SIZES:
            assert torch.equal(result["outputs"][n], _run(cold["model"], n))
        if run == "damaged":
            assert "clearing Inductor's cache" in child.stderr
        else:  # the cache it left behind serves a start without compiling
            assert result["counters"]["num_inductor_compiles"] == 0


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


def test_a_compiled_library_cut_short_is_removed_before_anything_loads_it(tmp_path):
    """A link cut short (killed, disk full) leaves a truncated .so that Inductor reuses as it is:
    loading it killed every start with SIGBUS (helper-25). Complete libraries stay, and so do
    young ones, which another process may still be writing."""
    from kiln.compilation.cache import elf_complete

    library = Path(torch._C.__file__).read_bytes()
    assert elf_complete(library[:64], len(library))
    assert not elf_complete(library[:64], 2000) and not elf_complete(b"", 0)
    cache = CompileCache(tmp_path / "key", "rank_0", "backbone")
    (cache.inductor_cache_dir / "ab").mkdir(parents=True)
    whole, cut, young = (cache.inductor_cache_dir / "ab" / f"{n}.main.so"
                         for n in ("whole", "cut", "young"))
    whole.write_bytes(library)
    cut.write_bytes(library[:2000])
    young.write_bytes(library[:2000])
    for path in (whole, cut):
        os.utime(path, (0, 0))
    assert cache.drop_cut_libraries() == [cut]
    assert whole.exists() and young.exists() and not cut.exists()


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


def test_cache_index_of_the_wrong_shape_starts_afresh(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    index = next(cache.glob("*/rank_0/ToyModel/index.json"))
    index.write_text("[]")
    compile_cache = CompileCache(index.parent.parent.parent, "rank_0", "ToyModel")
    assert compile_cache.index == {} and "not a JSON object" in kiln_logs.text
    index.write_text(json.dumps({"range/piece_0/inductor_standalone/f": "x"}))
    assert CompileCache(index.parent.parent.parent, "rank_0", "ToyModel").lookup(
        None, 0, "inductor_standalone", "f") is None


def test_two_builds_of_a_piece_keep_their_own_entries(tmp_path):
    """Keyed without the piece's fingerprint, two builds under one cache key (dummy and real
    weights) overwrote each other's entries: every switch recompiled every piece (helper-37)."""
    cache = CompileCache(tmp_path, "rank_0", "ToyModel")
    for fingerprint in ("a", "b"):
        cache.record(None, 0, "inductor_standalone", {"file": f"{fingerprint}.bin",
                                                        "fingerprint": fingerprint})
    again = CompileCache(tmp_path, "rank_0", "ToyModel")
    assert again.lookup(None, 0, "inductor_standalone", "a")["file"] == "a.bin"
    assert again.lookup(None, 0, "inductor_standalone", "b")["file"] == "b.bin"


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


def test_the_cpu_vector_isa_is_part_of_the_compilers_hash(monkeypatch):
    """Code for AVX-512 loaded where Inductor picks AVX2 (ATEN_CPU_CAPABILITY=avx2, or a cache
    copied to an older CPU) computed NaNs."""
    from kiln.compilation import compiler_interface

    cpu = InductorStandaloneAdaptor(device="cpu")
    before = cpu.compute_hash()
    monkeypatch.setattr(compiler_interface, "cpu_vec_isa_factor", lambda: "avx2|-mavx2")
    assert cpu.compute_hash() != before


def test_the_cpu_thread_count_is_part_of_the_compilers_hash():
    # Inductor writes num_threads(n) into code compiled with fewer threads than CPUs: a cache
    # shared across thread counts would pin a later run to the first run's count.
    cpu = InductorStandaloneAdaptor(device="cpu")
    threads = torch.get_num_threads()
    before = cpu.compute_hash()
    try:
        torch.set_num_threads(threads + 1)
        assert cpu.compute_hash() != before
    finally:
        torch.set_num_threads(threads)
    assert cpu.compute_hash() == before


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
