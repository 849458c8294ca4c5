"""The GGUF block kernel against gguf's own dequantization: every type, row count and dtype."""
import gguf
import numpy as np
import pytest
import torch

from kiln.native import gguf_matmul

pytestmark = pytest.mark.skipif(not gguf_matmul.available(),
                                reason="the GGUF kernel needs a C compiler and AVX-512")


def _blocks(qtype_name: str, out_features: int, in_features: int, seed: int = 0):
    """(uint8 blocks, float32 values they hold) for a random weight."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features))
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    blocks = gguf.quants.quantize(w.astype(np.float32), qtype)
    values = gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(values)


@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(qtype_name, dtype):
    qtype = gguf_matmul.QTYPES[qtype_name]
    # 3 blocks a row: the bfloat16 kernel's block pairs leave one over
    for out_features, in_features in ((96, 64), (40, 1536), (24, 96)):
        blocks, values = _blocks(qtype_name, out_features, in_features)
        assert gguf_matmul.serves(qtype, blocks, values.to(dtype))
        for rows in range(1, gguf_matmul.MAX_ROWS + 1):
            x = torch.randn(rows, in_features).to(dtype)
            bias = torch.randn(out_features).to(dtype)
            got = gguf_matmul.quantized_linear(x, blocks, qtype, out_features, bias)
            # bfloat16 multiplies the values as the dequantized bfloat16 weight holds them
            want = x.float() @ values.to(dtype).float().T + bias.float()  # [rows, out]
            assert got.dtype == dtype and got.shape == (rows, out_features)
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
            assert (got.float() - want).abs().max() <= tol * want.abs().max()
    x3 = torch.randn(2, 3, in_features).to(dtype)  # leading dims are rows too
    assert gguf_matmul.quantized_linear(x3, blocks, qtype, out_features).shape == (2, 3, 24)


def test_what_it_refuses():
    blocks, values = _blocks("Q4_1", 8, 64)
    q41 = gguf_matmul.QTYPES["Q4_1"]
    assert not gguf_matmul.serves(q41, blocks, values[:, :32])  # blocks of another width
    assert not gguf_matmul.serves(q41, blocks[:4], values)  # other row count
    assert not gguf_matmul.serves(gguf_matmul.QTYPES["Q8_0"], blocks, values)  # other type
    assert not gguf_matmul.serves(14, blocks, values)  # a type the kernel does not read (Q6_K)
    assert not gguf_matmul.serves(q41, blocks, values.half())  # a dtype the kernel lacks
    with pytest.raises(RuntimeError, match="bad row count"):
        gguf_matmul.quantized_linear(torch.randn(gguf_matmul.MAX_ROWS + 1, 64), blocks, q41, 8)
