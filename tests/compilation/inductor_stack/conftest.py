"""The Inductor stack tests' shared state: a Kiln cache root of their own, the simdlen children
started first, and one cold compile of the toy model shared by every module here."""
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kiln import envs
from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.counters import compilation_counter
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm
from .toy_compiles import HERE


@pytest.fixture(scope="package", autouse=True)
def _own_cache_root(tmp_path_factory):
    """A Kiln cache root of this package's own (children inherit it): the machine's one is shared
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


@pytest.fixture(scope="package")
def simdlen_children(_own_cache_root, tmp_path_factory):
    """Started with the module: the two children run while this process compiles `cold` (the
    suite's machine has two cores). The environment as now, before any test changes it."""
    env = {k: v for k, v in os.environ.items() if k != "KILN_DISABLE_COMPILE_CACHE"}
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_simdlen_children, tmp_path_factory.mktemp("simdlen") / "cache", env)


@pytest.fixture(scope="package")
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
