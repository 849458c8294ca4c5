"""The IR op `gguf_linear`: a linear whose weight is a GGUF file's blocks, in the layout Kiln keeps
them in (gguf_layout.py); its meaning is theirs alone, its native kernel reads them directly.

The choice of kernel per row count, for a layer that also holds a dense (and packed) copy:
the native implementation takes the blocks for up to `plan`'s block_rows rows (the row count
where they stop beating the dense weight's kernels, gguf_matmul.rows_worth_it by type and
dtype), and the dense copy's kernel above (linear's: GEMV, oneDNN's packed GEMM or aten);
without a dense copy the packed one above (a layer lets its dense copy go when nothing would
read it: cpu_gemm.release_dense_copies), with neither the blocks at every row count. One rule,
`kiln::linear_path`
(csrc/linear_op.cpp, kiln/native/linear_op.choose_path), made per call in C++.
"""
import torch
import torch.nn.functional as F

from kiln.ir import gguf_layout
from kiln.ir.op import define


def _gguf_linear_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int,
                     bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     packed: torch.Tensor | None = None,
                     plan: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (float) @ W^T (+ bias [out]) -> [..., out_features] in x's dtype, W the
    blocks' values: uint8 blocks of ggml type `qtype` (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q5_K 13,
    Q6_K 14) of an [out_features, in] weight in Kiln's layout (gguf_layout.fits), dequantized
    exactly in float32, rounded to x's dtype, then F.linear. `weight` (that dequantization in
    x's dtype), `packed` (its oneDNN copy) and `plan` (int64 [gemv_rows, block_rows, limbs])
    are other forms of the same values and which kernel serves how many rows: the native
    implementation may read them instead (see the module docstring); this one does not. The
    blocks kernel takes integer dot products against x cut into int8 limbs (plan's limbs, 3 by
    default): within a few times float32's rounding, or, for bfloat16 x and 2 limbs, x held to
    2^-13 of each 32 values' largest."""
    w = gguf_layout.dequantize(blocks, qtype, out_features, x.shape[-1])  # [out, in] float32
    return F.linear(x, w.to(x.dtype), bias)


def _gguf_linear_fake(x, blocks, qtype, out_features, bias=None, weight=None, packed=None,
                      plan=None):
    return x.new_empty((*x.shape[:-1], out_features))


def _examples(dtype: torch.dtype, device: str):
    """Q4_0 blocks of a [16, 64] weight (zeros: every scale 0), with its dense copy."""
    shape = gguf_layout.kernel_shape(2, 16, 64)
    return (torch.randn(2, 64, device=device).to(dtype),
            torch.zeros(shape, dtype=torch.uint8, device=device), 2, 16, None,
            torch.zeros(16, 64, dtype=dtype, device=device))


# the arguments after x (the fusion passes carry them into a fused op)
TAIL = ("Tensor blocks, int qtype, int out_features, Tensor? bias=None, Tensor? weight=None, "
        "Tensor? packed=None, Tensor? plan=None")

gguf_linear = define("gguf_linear", f"(Tensor x, {TAIL}) -> Tensor", _gguf_linear_ref,
                     _gguf_linear_fake, _examples)
