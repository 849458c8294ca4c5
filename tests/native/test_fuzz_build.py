"""Building and loading the CPU kernels, adversarially: loading them must not change the process's
floating point (GCC's -ffast-math links crtfastmath.o, whose constructor sets FTZ/DAZ for the
whole process), and a damaged cached library is rebuilt instead of leaving the kernels off."""
import os
import shutil
import subprocess
import sys

import pytest

from kiln import envs
from kiln.native import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")

_SUBNORMAL_SCRIPT = """
import torch
from kiln.native import build

def subnormal():  # 1e-38 / 100 is a subnormal float32; flushed to zero under FTZ/DAZ
    return (torch.tensor([1e-38]) / 100).item()

assert subnormal() > 0, "subnormals already flushed before loading"
assert build.available(), "the kernels did not build"
torch.ops.kiln.rms_norm_native(torch.randn(2, 8), torch.ones(8), 1e-6)
assert subnormal() > 0, "loading the kernels flushed subnormals to zero"
print("ok")
"""


def test_loading_the_kernels_keeps_subnormals():
    """torch's float32 results must be the same before and after Kiln's kernels load."""
    proc = subprocess.run([sys.executable, "-c", _SUBNORMAL_SCRIPT], capture_output=True,
                          text=True, env=dict(os.environ), timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_the_cached_library_is_readable_by_others(cached_kernels):
    """A cache root shared between users: the library must be world-readable (dlopen reads)."""
    assert build.build(build.compiler()).stat().st_mode & 0o444 == 0o444


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "half-truncated":
        data = data[:len(data) // 2]
    else:
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))


_RUN_SCRIPT = """
import sys
from kiln import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, kv_cache_memory=0.02)
out = llm.generate([{"prompt_token_ids": [5, 17, 42]}], SamplingParams(temperature=0,
                   max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
print("tokens", out.token_ids)
print("text", repr(out.text))
"""


def test_an_engine_over_a_damaged_kernel_cache_rebuilds_and_prints_the_same_text(
        tiny_llama_dir, tmp_path):
    """A run whose cached kernel library was damaged rebuilds it and prints what a run over an
    intact cache prints (same tokens, same text). Mapped as it was, a half-truncated library
    crashed every start (SIGBUS); its checksum catches that and flipped bytes before loading.
    One rebuild here covers both (a full build takes a minute on 2 cores)."""
    # the child reads this cache, not this process's copy (build.INHERITED_LIBRARY_ENV)
    env = {**{k: v for k, v in os.environ.items() if k != build.INHERITED_LIBRARY_ENV},
           "KILN_CACHE_ROOT": str(tmp_path / "cache"), "KILN_REQUIRE_NATIVE": "1"}
    cxx = build.compiler()
    built = build.build(cxx).parent  # this machine's build of these sources: no compile here
    shutil.copytree(built, tmp_path / "cache" / "kernels" / built.name)

    def run():
        proc = subprocess.run([sys.executable, "-c", _RUN_SCRIPT, str(tiny_llama_dir)],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line for line in proc.stdout.splitlines() if line.startswith(("tokens", "text"))]

    intact_run = run()
    damaged = (tmp_path / "cache" / "kernels"
               / build.library_path(cxx).relative_to(envs.cache_root() / "kernels"))
    assert build.intact(damaged), damaged
    size = damaged.stat().st_size
    _damage(damaged, "flipped-bytes")
    assert not build.intact(damaged)
    _damage(damaged, "half-truncated")
    assert not build.intact(damaged)
    (damaged.parent / "build-killed").mkdir()  # a build SIGKILLed before its cleanup
    assert run() == intact_run
    assert build.intact(damaged) and damaged.stat().st_size == size
    # Nothing but the library, its checksum and the lock beside it (no build folder left, a
    # killed build's neither: helper-25).
    assert sorted(p.name for p in damaged.parent.iterdir()) == sorted([
        ".lock", damaged.name, damaged.name + ".sha256"])
