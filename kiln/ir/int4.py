"""The IR op `int4_weight_linear` (W4A16: 4-bit weights, group-wise float scales, activations in the
model dtype) on Kiln's canonical int4 layout, and its pack/unpack helpers; the native provider
(kiln/native/int4_linear.py) reads that layout as it is held in memory.

Canonical layout (compressed-tensors' pack-quantized rows; GPTQ and AWQ are converted to it at
load): `w_packed` int32 [N, K / 8], value k of row n in word k // 8 at bits 4 (k % 8), stored
unsigned (0..15); `scales` [N, K / G] float32, bfloat16 or float16; `zeros` uint8 [N, K / G]
unsigned zero points (GPTQ's may reach 16), None meaning 8 (symmetric).
w[n, k] = (u - z) * scale of k's group.
"""
import torch
import torch.nn.functional as F

from kiln.ir.op import define

PACK = 8  # 4-bit values an int32 holds


def _shifts(device, trailing: int) -> torch.Tensor:
    # made per call, not a module constant: the reference is inlined into compiled graphs,
    # where a captured real tensor is not allowed
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device).view(-1, *([1] * trailing))


def unpack_int4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """int32 words of 8 unsigned 4-bit values (low bits first) -> int32 values, `dim` 8x longer."""
    dim = dim % packed.dim()
    nibbles = (packed.unsqueeze(dim + 1) >> _shifts(packed.device, packed.dim() - dim - 1)) & 15
    return nibbles.flatten(dim, dim + 1)


def pack_int4(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """unpack_int4's inverse: unsigned 4-bit values (any int dtype; `dim` a multiple of 8) ->
    int32 words."""
    dim = dim % values.dim()
    shape = (*values.shape[:dim], values.shape[dim] // PACK, PACK, *values.shape[dim + 1:])
    v = values.to(torch.int32).reshape(shape) << _shifts(values.device, values.dim() - dim - 1)
    return v.sum(dim + 1, dtype=torch.int32)  # disjoint bits: the sum is their OR


def dequantize_int4(w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """The canonical layout's values, float32 [N, K] (exact: a 4-bit difference times a scale)."""
    n, groups = scales.shape
    u = unpack_int4(w_packed).view(n, groups, group_size)  # [N, K / G, G]
    z = 8 if zeros is None else zeros.to(torch.int32).unsqueeze(-1)
    w = (u - z).to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return w.view(n, groups * group_size)


def _int4_linear_ref(x: torch.Tensor, w_packed: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias [N]) -> [..., N] in x's dtype, W the canonical layout's values
    (dequantize_int4, float32) rounded to x's dtype, then F.linear."""
    w = dequantize_int4(w_packed, scales, zeros, group_size)
    return F.linear(x, w.to(x.dtype), bias)


def _int4_linear_fake(x, w_packed, scales, zeros, group_size, bias=None):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]))


def _examples(dtype: torch.dtype, device: str):
    """A [16, 64] weight in groups of 32 (zeros everywhere)."""
    return (torch.randn(2, 64, device=device).to(dtype),
            torch.zeros(16, 8, dtype=torch.int32, device=device),
            torch.ones(16, 2, dtype=torch.float32, device=device),
            torch.full((16, 2), 8, dtype=torch.uint8, device=device), 32, None)


int4_weight_linear = define(
    "int4_weight_linear", "(Tensor x, Tensor w_packed, Tensor scales, Tensor? zeros, "
    "int group_size, Tensor? bias=None) -> Tensor", _int4_linear_ref, _int4_linear_fake, _examples)
