"""Python side of csrc/linear_op.cpp, the C++ CPU kernel of the IR op `linear`
(`kiln::linear_native`): which path its calls took. What its calls choose from (oneDNN's packed
copy, the GGUF blocks, the plan) the layer holds and passes with its weight
(kiln/model/layers/cpu_gemm.py).
"""
import torch

from kiln.native import build

PATHS = ("blocks", "gemv", "packed", "dense")  # the op's choices, in its order of preference


def available() -> bool:
    """The kernels built and loaded; False (with one warning) when they cannot be built."""
    return build.available()


def path_counts() -> dict[str, int]:
    """Calls so far by the path the op took (process-wide), for tests and benchmarks."""
    return dict(zip(PATHS, torch.ops.kiln.linear_path_counts()))
