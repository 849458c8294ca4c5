"""Building and loading the C kernels, adversarially: loading them must not change the process's
floating point (GCC's -ffast-math links crtfastmath.o, whose constructor sets FTZ/DAZ for the
whole process), and a damaged cached library is rebuilt instead of leaving the kernels off."""
import os
import shutil
import subprocess
import sys

import pytest

from kiln import envs
from kiln.native import build, gemv

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")

_C_KERNELS = ("gemv", "layer_ops", "paged_attention", "gguf_matmul", "gguf_layout")

_SUBNORMAL_SCRIPT = f"""
import torch
from kiln.native import build

def subnormal():  # 1e-38 / 100 is a subnormal float32; flushed to zero under FTZ/DAZ
    return (torch.tensor([1e-38]) / 100).item()

assert subnormal() > 0, "subnormals already flushed before loading"
for name in {_C_KERNELS!r}:
    build.load(name, ())
    assert subnormal() > 0, f"loading the {{name}} kernels flushed subnormals to zero"
print("ok")
"""


def test_loading_the_kernels_keeps_subnormals():
    """torch's float32 results must be the same before and after Kiln's kernels load."""
    proc = subprocess.run([sys.executable, "-c", _SUBNORMAL_SCRIPT], capture_output=True,
                          text=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_a_truncated_cached_library_is_rebuilt(fresh_kernels):
    cc = build.compiler()
    path = build.build("gemv", cc)
    with open(path, "r+b") as f:  # a crash or a full disk mid-copy, say
        f.truncate(100)
    assert gemv.available()
    assert path.stat().st_size > 100 and build.intact(path)


@pytest.mark.parametrize("damage", ["half-truncated", "flipped-bytes"])
def test_a_damaged_cached_library_fails_its_checksum_and_is_rebuilt(fresh_kernels, damage):
    """Mapped as it is, a half-truncated library crashed every start (SIGBUS); the checksum
    catches it (and flipped bytes) before it is loaded."""
    path = build.build("layer_ops", build.compiler())
    good = path.read_bytes()
    _damage(path, damage)
    assert not build.intact(path)
    assert build.load("layer_ops", ()) is not None
    assert build.intact(path) and path.read_bytes() == good


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
    """A run whose cached C and C++ libraries were damaged rebuilds them and prints what a run
    over an intact cache prints (same tokens, same text)."""
    env = {**os.environ, "KILN_CACHE_ROOT": str(tmp_path / "cache"), "KILN_REQUIRE_NATIVE": "1"}
    built = envs.cache_root() / "kernels"  # this machine's builds, if any: fewer compiles
    if built.is_dir():
        shutil.copytree(built, tmp_path / "cache" / "kernels")

    def run():
        proc = subprocess.run([sys.executable, "-c", _RUN_SCRIPT, str(tiny_llama_dir)],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line for line in proc.stdout.splitlines() if line.startswith(("tokens", "text"))]

    intact_run = run()
    # The libraries of these sources (the copy may hold other checkouts' builds too).
    cache = tmp_path / "cache" / "kernels"
    damaged = [cache / build.library_path(name, cc, cpp).relative_to(envs.cache_root() / "kernels")
               for name, cc, cpp in (("layer_ops", build.compiler(), False),
                                     ("linear_op", build.cxx_compiler(), True))]
    assert all(build.intact(p) for p in damaged), damaged
    _damage(damaged[0], "half-truncated")
    _damage(damaged[1], "flipped-bytes")
    assert run() == intact_run
    assert all(build.intact(p) for p in damaged)


def test_the_cached_library_is_readable_by_others(fresh_kernels):
    """A cache root shared between users: the library must be world-readable (dlopen reads)."""
    path = build.build("gemv", build.compiler())
    assert path.stat().st_mode & 0o444 == 0o444
