"""Python side of csrc/linear_op.cpp, the C++ CPU kernels of the IR ops `linear` and `gguf_linear`
(`kiln::linear_native`, `kiln::gguf_linear_native`): which path a call takes, and which its calls
took. What they choose from (oneDNN's packed copy, the GGUF blocks, the plan) the layer holds
and passes with its weight (kiln/model/layers/cpu_gemm.py).
"""
import torch

from kiln.native import build

PATHS = ("blocks", "gemv", "packed", "dense")  # the ops' choices, in their order of preference


def available() -> bool:
    """The kernels built and loaded; False (with one warning) when they cannot be built."""
    return build.available()


def choose_path(rows: int, blocks: bool, dense: bool, packed: bool,
                plan: torch.Tensor | None) -> str | None:
    """The path a call of `rows` rows takes, holding (or not) blocks the kernel can read for it,
    a dense weight, its packed copy and a plan (int64 [gemv_rows, block_rows, limbs]): the
    blocks up to block_rows rows, or at any count when they are all there is; else GEMV (on
    the dense weight) up to gemv_rows; else packed, else dense. None: nothing serves it. The
    kernels' own rule
    (`kiln::linear_path`), not a copy of it."""
    path = torch.ops.kiln.linear_path(rows, blocks, dense, packed, plan)
    return PATHS[path] if path >= 0 else None


def path_counts() -> dict[str, int]:
    """Calls so far by the path the op took (process-wide), for tests and benchmarks."""
    return dict(zip(PATHS, torch.ops.kiln.linear_path_counts()))
