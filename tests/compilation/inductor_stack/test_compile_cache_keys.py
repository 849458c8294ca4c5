"""The compile cache's key: what goes into it (config, sources, compiler, the IR and passes, the
CPU's vector ISA and thread count), another checkout sharing the cache, the cache root."""
from pathlib import Path

import torch

from kiln.compilation.backend import KilnBackend
from kiln.compilation.cache import cache_base_dir, compute_cache_key
from kiln.compilation.compiler_interface import InductorStandaloneAdaptor

import toy_model as tm


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
