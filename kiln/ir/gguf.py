"""The IR ops on a GGUF file's blocks, in the layout Kiln keeps them in (gguf_layout.py):
`gguf_linear`, a linear whose weight they are, and `gguf_embedding`, a lookup of their rows (a
tied embedding reading its LM head's blocks); their meaning is the blocks' alone, their native
kernels read them directly.

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


def _gguf_embedding_ref(ids: torch.Tensor, blocks: torch.Tensor, qtype: int, num_embeddings: int,
                        embedding_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """ids (int64 or int32, any shape) -> [*ids.shape, embedding_dim] in dtype: rows `ids` of
    the [num_embeddings, embedding_dim] weight whose blocks (ggml type `qtype`, Kiln's layout)
    these are, dequantized exactly in float32 (gguf_layout.dequantize), then rounded to dtype;
    an id outside the vocabulary is an IndexError, as in F.embedding. (Equal values to gguf's
    own dequantization; Q4_0's zeros come out +0 where gguf's d * (q - 8) gives -0 for d < 0,
    which nothing after an embedding can tell apart.)"""
    flat = ids.reshape(-1)
    if flat.numel() and not bool(((flat >= 0) & (flat < num_embeddings)).all()):
        raise IndexError(f"gguf_embedding: a token id is outside the vocabulary "
                         f"[0, {num_embeddings})")
    group = gguf_layout.GROUP_ROWS
    # each id's whole group of rows, dequantized as a weight of its own; then the id's row
    groups = blocks.view(-1, group * blocks.shape[1])[flat // group]  # [T, 16 * row_bytes]
    rows = gguf_layout.dequantize(groups.view(-1, blocks.shape[1]), qtype, flat.numel() * group,
                                  embedding_dim).view(-1, group, embedding_dim)  # [T, 16, H]
    picked = rows[torch.arange(flat.numel(), device=ids.device), flat % group]  # [T, H]
    return picked.to(dtype).view(*ids.shape, embedding_dim)


def _gguf_embedding_fake(ids, blocks, qtype, num_embeddings, embedding_dim, dtype):
    return blocks.new_empty((*ids.shape, embedding_dim), dtype=dtype)


def _embedding_examples(dtype: torch.dtype, device: str):
    """Q8_0 blocks of a [16, 32] table (zeros), and two ids."""
    shape = gguf_layout.kernel_shape(8, 16, 32)
    return (torch.tensor([0, 15], device=device),
            torch.zeros(shape, dtype=torch.uint8, device=device), 8, 16, 32, dtype)


gguf_embedding = define("gguf_embedding", "(Tensor ids, Tensor blocks, int qtype, "
                        "int num_embeddings, int embedding_dim, ScalarType dtype) -> Tensor",
                        _gguf_embedding_ref, _gguf_embedding_fake, _embedding_examples)
