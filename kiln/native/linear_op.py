"""Python side of csrc/linear_op.cpp, the C++ CPU kernel of `kiln::linear`: loading it, and
attaching to a weight what its calls choose from (oneDNN's packed copy, the GGUF blocks).

The op finds these by the weight's address at run time, so a traced graph carries only the
ordinary weight; it checks that the tensor is still that weight (same storage, shape, dtype).
A weight's attachments are dropped when it is freed.
"""
import ctypes
import functools
import weakref
from typing import NamedTuple

import torch

from kiln import envs
from kiln.native import build, gemv, gguf_matmul, layer_ops

PATHS = ("blocks", "gemv", "packed", "dense")  # the op's choices, in its order of preference


@functools.cache
def available() -> bool:
    """The C++ kernel built and loaded, with the C kernels it calls handed over (those that
    built; the SiLU-and-mul one not under KILN_NATIVE_CPU_OPS=0); False (with one warning) when
    it cannot be built."""
    if not build.load_torch_op("linear_op"):
        return False

    def address(lib, fn):
        return ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value if lib is not None else 0

    torch.ops.kiln._cpu_linear_set_kernels(address(gemv._lib(), "kiln_gemv"),
                                           address(gguf_matmul._lib(), "kiln_gguf_matmul"),
                                           address(layer_ops._lib() if envs.native_cpu_ops()
                                                   else None, "kiln_silu_and_mul"))
    return True


class Attached(NamedTuple):
    packed: bool  # a oneDNN-packed copy
    gemv_rows: int  # up to how many rows the GEMV kernel takes the weight (0: never)
    blocks: bool  # GGUF blocks
    qtype: int  # their ggml type id
    block_rows: int  # up to how many rows they serve (0: never)
    limbs: int  # float32 x's int8 limbs in their kernel (gguf_matmul.float32_limbs; 0: none)


def attached(weight: torch.Tensor) -> Attached:
    """What the weight carries (nothing for another tensor at its address: a view of it, or a
    later tensor once it is freed)."""
    packed, gemv_rows, blocks, qtype, block_rows, limbs = torch.ops.kiln._cpu_linear_attached(
        weight)
    return Attached(bool(packed), gemv_rows, bool(blocks), qtype, block_rows, limbs)


def _forget_when_freed(weight: torch.Tensor) -> None:
    # By address and storage (its StorageImpl's address), so that a weight freed after another
    # took its address over (module.to(dtype) frees the storage, not the Parameter) leaves the
    # newcomer's entry alone.
    done = weakref.finalize(weight, torch.ops.kiln._cpu_linear_detach, weight.data_ptr(),
                            weight.untyped_storage()._cdata)
    done.atexit = False  # the process is ending: nothing to reuse the address


def attach_packed(weight: torch.Tensor, packed: torch.Tensor, gemv_rows: int) -> None:
    """Calls with more rows than gemv_rows (or with GEMV off: 0) take oneDNN's `packed` copy
    of `weight`; those with fewer, the GEMV kernel on the dense weight."""
    torch.ops.kiln._cpu_linear_attach_packed(weight, packed, gemv_rows)
    _forget_when_freed(weight)


def attach_blocks(weight: torch.Tensor, blocks: torch.Tensor, qtype: int, max_rows: int,
                  limbs: int = 3) -> None:
    """Calls of up to max_rows rows read `blocks` (that `gguf_matmul.serves` accepted, in the
    kernel's layout: `gguf_matmul.kernel_blocks`), float32 x in `limbs` limbs
    (`gguf_matmul.float32_limbs`)."""
    if max_rows > 0:  # the kernel reads the whole shape without bounds: refuse any other
        want = gguf_matmul.kernel_shape(qtype, *weight.shape)
        if tuple(blocks.shape) != want or blocks.dtype != torch.uint8:
            raise ValueError(f"blocks {blocks.dtype} {tuple(blocks.shape)} are not the kernel "
                             f"layout {want} of weight {tuple(weight.shape)} (ggml type {qtype}): "
                             "convert the file's blocks with gguf_matmul.kernel_blocks")
    torch.ops.kiln._cpu_linear_attach_blocks(weight, blocks, qtype, max_rows, limbs)
    _forget_when_freed(weight)


def num_attached() -> int:
    """Weights with something attached, process-wide (a freed weight's entry goes with it)."""
    return torch.ops.kiln._cpu_linear_num_attached()


def path_counts() -> dict[str, int]:
    """Calls so far by the path the op took (process-wide), for tests and benchmarks."""
    return dict(zip(PATHS, torch.ops.kiln._cpu_linear_path_counts()))
