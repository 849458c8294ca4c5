"""The IR op `int4_weight_linear` (W4A16: 4-bit weights, group-wise float scales, activations in the
model dtype) on Kiln's canonical int4 layout, its pack/unpack helpers, and the conversion of that
layout into the Q4_1 kernel blocks the native GGUF kernel reads (gguf_layout.py).

Canonical layout (compressed-tensors' pack-quantized rows; GPTQ and AWQ are converted to it at
load): `w_packed` int32 [N, K / 8], value k of row n in word k // 8 at bits 4 (k % 8), stored
unsigned (0..15); `scales` float32 [N, K / G]; `zeros` uint8 [N, K / G] unsigned zero points
(GPTQ's may reach 16), None meaning 8 (symmetric). w[n, k] = (u - z) * scale of k's group.
"""
import torch
import torch.nn.functional as F

from kiln.ir import gguf_layout
from kiln.ir.op import define

PACK = 8  # 4-bit values an int32 holds
Q4_1 = 3  # ggml type id of the blocks the native kernel takes (a q + b per 32 values)


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


def converts_to_blocks(in_features: int, group_size: int) -> bool:
    """Whether a weight of this width and group size fits Q4_1 blocks of 32 values (each block
    within one group)."""
    return in_features % gguf_layout.QK == 0 and group_size % gguf_layout.QK == 0


def to_q4_1_blocks(w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
    """The canonical layout as Q4_1 kernel blocks (gguf_layout.fits for qtype 3, [N, K]): per 32
    values a = the group's scale and b = -a z in float32, so a u + b equals dequantize_int4
    exactly. 6 bits a weight (4 of values, 2 of float32 scales per 32)."""
    n, k = w_packed.shape[0], w_packed.shape[1] * PACK
    rows = gguf_layout.GROUP_ROWS
    groups, nb = -(-n // rows), k // gguf_layout.QK
    u = torch.zeros(groups * rows, k, dtype=torch.int32, device=w_packed.device)
    u[:n] = unpack_int4(w_packed)
    per_block = group_size // gguf_layout.QK
    a = torch.zeros(groups * rows, nb, dtype=torch.float32, device=w_packed.device)
    a[:n] = scales.to(torch.float32).repeat_interleave(per_block, dim=1)
    z = torch.zeros_like(a)
    z[:n] = 8.0 if zeros is None else zeros.to(torch.float32).repeat_interleave(per_block, dim=1)
    b = -(a * z)
    # scales: [g, nb, (a, b), 16 rows] float32 -> 128 bytes a group and block
    ab = torch.stack((a, b), dim=-1).view(groups, rows, nb, 2).permute(0, 2, 3, 1)
    scale_bytes = ab.contiguous().view(torch.uint8).reshape(groups, nb, -1)
    # values: value t in byte t's low nibble, t + 16 in its high one; row c's bytes 4i .. 4i + 3
    # at 64i + 4c
    q = u.view(groups, rows, nb, gguf_layout.QK).permute(0, 2, 1, 3)  # [g, nb, 16, 32]
    byte = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # [g, nb, 16 c, 16]
    values = byte.reshape(groups, nb, rows, 4, 4).transpose(2, 3).reshape(groups, nb, -1)
    return torch.cat((scale_bytes, values), dim=-1).reshape(groups * rows, -1).contiguous()
