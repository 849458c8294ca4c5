"""Building and loading the C kernels, adversarially: loading them must not change the process's
floating point (GCC's -ffast-math links crtfastmath.o, whose constructor sets FTZ/DAZ for the
whole process), and a damaged cached library is rebuilt instead of leaving the kernels off."""
import os
import subprocess
import sys

import pytest

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
    assert path.stat().st_size > 100
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_the_cached_library_is_readable_by_others(fresh_kernels):
    """A cache root shared between users: the library must be world-readable (dlopen reads)."""
    path = build.build("gemv", build.compiler())
    assert path.stat().st_mode & 0o444 == 0o444
