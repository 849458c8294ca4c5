"""GGUF blocks for tests: quantized by gguf-py where it can, random K-quant blocks where it cannot
(gguf-py dequantizes K-quants but does not quantize to them)."""
import gguf
import numpy as np

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
