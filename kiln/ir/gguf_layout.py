"""The layout Kiln keeps a weight's GGUF blocks in (made once at load by csrc/gguf_layout.c, read
by the blocks kernel), as torch reads it: its shape, and its values dequantized in plain torch.

Per 32 values a block with float32 scales (gguf_blocks.h), interleaved in groups of 16 output
rows: a group's block j is the 16 rows' first scales, [their second ones], then their values,
row c's bytes 4i .. 4i + 3 at 64i + 4c (4-bit values two a byte: value t in byte t's low
nibble, t + 16 in its high one), then for Q5_K 8 masks of 64 bits (bit 4c + i of mask j: row
c's value 4j + i's fifth bit). The last group is padded with zero rows.
"""
from typing import NamedTuple

import torch

QK = 32  # values per kernel block
GROUP_ROWS = 16  # output rows interleaved together


class Layout(NamedTuple):
    file_values: int  # values per block of the file (32, or 256 for the K-quants)
    scales: int  # float32 scales per kernel block (a, and b where values are a q + b)
    value_bytes: int  # bytes of values per kernel block (16: 4-bit values two a byte)
    block_bytes: int  # bytes of a kernel block, its masks included
    offset: int  # what the stored values exceed the quantized ones by (Q6_K 32, Q8_0 128)


# by ggml type id: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
LAYOUTS = {2: Layout(32, 2, 16, 24, 0), 3: Layout(32, 2, 16, 24, 0), 8: Layout(32, 1, 32, 36, 128),
           12: Layout(256, 2, 16, 24, 0), 13: Layout(256, 2, 16, 28, 0),
           14: Layout(256, 2, 32, 40, 32)}
_Q5_K, _Q6_K = 13, 14


def kernel_shape(qtype: int, out_features: int, in_features: int) -> tuple[int, int] | None:
    """[rows rounded up to whole groups, bytes a row] of an [out, in] weight's blocks of qtype;
    None for a type Kiln keeps no blocks of or a width that is not whole blocks."""
    layout = LAYOUTS.get(qtype)
    if layout is None or in_features <= 0 or in_features % layout.file_values:
        return None
    groups = -(-out_features // GROUP_ROWS)
    return groups * GROUP_ROWS, in_features // QK * layout.block_bytes


def fits(blocks: torch.Tensor, qtype: int, out_features: int, in_features: int) -> bool:
    """Whether `blocks` is uint8 in this layout for an [out_features, in_features] weight."""
    shape = kernel_shape(qtype, out_features, in_features)
    return (shape is not None and out_features > 0 and blocks.dtype == torch.uint8
            and blocks.dim() == 2 and tuple(blocks.shape) == shape and blocks.is_contiguous())


def _fifth_bits(masks: torch.Tensor) -> torch.Tensor:
    """masks uint8 [..., 8 masks, 8 bytes] -> int32 [..., 16 rows, 32 values] of 0 or 16."""
    rows = torch.arange(GROUP_ROWS, device=masks.device)
    nibbles = (masks.to(torch.int32).index_select(-1, rows // 2)
               >> ((rows % 2) * 4).to(torch.int32)) & 15  # [..., 8 j, 16 c]
    bits = (nibbles.unsqueeze(-1) >> torch.arange(4, device=masks.device, dtype=torch.int32)) & 1
    return bits.transpose(-3, -2).flatten(-2) << 4  # [..., 16 c, 32 (4 j + i)]


def dequantize(blocks: torch.Tensor, qtype: int, out_features: int,
               in_features: int) -> torch.Tensor:
    """blocks uint8 in this layout (`fits`) -> the weight's values, float32 [out, in]: exactly
    gguf's dequantization of the file's blocks (a q + b with the float32 scales stored here)."""
    layout = LAYOUTS[qtype]
    nb, groups = in_features // QK, blocks.shape[0] // GROUP_ROWS
    chunk = blocks.reshape(groups, nb, GROUP_ROWS * layout.block_bytes)
    scale_bytes = 4 * GROUP_ROWS * layout.scales
    scales = chunk[..., :scale_bytes].contiguous().view(torch.float32).reshape(
        groups, nb, layout.scales, GROUP_ROWS, 1)  # [g, nb, scales, 16 rows, 1]
    values = chunk[..., scale_bytes:scale_bytes + GROUP_ROWS * layout.value_bytes]
    values = values.reshape(groups, nb, layout.value_bytes // 4, GROUP_ROWS, 4)
    values = values.transpose(2, 3).reshape(groups, nb, GROUP_ROWS, layout.value_bytes)
    q = values.to(torch.int32)
    if layout.value_bytes == 16:  # two 4-bit values a byte
        q = torch.cat((q & 15, q >> 4), dim=-1)  # [g, nb, 16, 32]
    if qtype == _Q5_K:
        start = scale_bytes + GROUP_ROWS * layout.value_bytes
        q = q | _fifth_bits(chunk[..., start:start + 64].reshape(groups, nb, 8, 8))
    q = (q - layout.offset).to(torch.float32)
    if qtype == _Q6_K:  # a scale per 16 values
        w = scales.squeeze(-1).transpose(-2, -1).repeat_interleave(16, dim=-1) * q
    elif layout.scales == 2:
        w = scales[:, :, 0] * q + scales[:, :, 1]
    else:
        w = scales[:, :, 0] * q
    # [g, nb, 16, 32] -> [g, 16, nb, 32] -> [rows, in]
    return w.transpose(1, 2).reshape(groups * GROUP_ROWS, in_features)[:out_features]
