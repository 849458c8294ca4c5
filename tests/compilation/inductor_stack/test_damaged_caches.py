"""A damaged compile cache: corrupt, deleted or forgotten artifacts, Inductor's own cache damaged
or left behind, a library cut short, an index of the wrong shape, two builds of a piece."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from _child import SIZES

from kiln.compilation.cache import CompileCache, index_key
from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.counters import compilation_counter
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm
from .toy_compiles import HERE, _run, _warm_model


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
