"""GGUF blocks for tests: quantized by gguf-py where it can, random K-quant blocks where it cannot
(gguf-py dequantizes K-quants but does not quantize to them)."""
import gguf
import numpy as np
import pytest
import torch

from kiln.native import gguf_matmul

needs_kernel = pytest.mark.skipif(not gguf_matmul.kernel_available(),
                                  reason="the GGUF kernel needs AVX-512")

# Where each K-quant block keeps its fp16 super-scales: random bytes there get small finite values.
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantized_blocks(values: np.ndarray, qtype_name: str, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] blocks of type `qtype_name` for a [rows, cols] weight: `values`
    quantized, or for a K-quant random blocks of that shape (dequantize them for their values)."""
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    if qtype_name not in K_SCALE_OFFSETS:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    rows, cols = values.shape
    rng = np.random.default_rng(seed)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype_name]:
        scale = rng.uniform(0.001, 0.01, raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def file_blocks(name: str, out_features: int, in_features: int, seed: int = 0):
    """(the file's uint8 blocks, their values float32 [out, in] by gguf's dequantize)."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features))
    blocks = quantized_blocks(w, name, seed)
    values = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, name))
    return (torch.from_numpy(np.ascontiguousarray(blocks)),
            torch.from_numpy(values.astype(np.float32).reshape(out_features, in_features)))


def kernel_blocks(name: str, out_features: int, in_features: int, seed: int = 0):
    """(the blocks in the kernel's layout, their values float32 [out, in])."""
    blocks, values = file_blocks(name, out_features, in_features, seed)
    return gguf_matmul.kernel_blocks(gguf_matmul.QTYPES[name], blocks), values
