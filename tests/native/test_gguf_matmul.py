"""The GGUF block kernel against gguf's own dequantization: every type, row count and dtype."""
import gguf
import numpy as np
import pytest
import torch

from kiln.native import gguf_matmul

from gguf_blocks import quantized_blocks

pytestmark = pytest.mark.skipif(not gguf_matmul.available(),
                                reason="the GGUF kernel needs a C compiler and AVX-512")


def _blocks(qtype_name: str, out_features: int, in_features: int, seed: int = 0):
    """(uint8 blocks, float32 values they hold) for a random weight."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features))
    blocks = quantized_blocks(w, qtype_name, seed)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    values = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
    return (torch.from_numpy(np.ascontiguousarray(blocks)),
            torch.from_numpy(values.reshape(out_features, in_features)))


@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(qtype_name, dtype):
    qtype = gguf_matmul.QTYPES[qtype_name]
    # in groups of 16 rows
    shapes = ((96, 256), (48, 1536), (16, 768)) if "_K" in qtype_name else (
        (96, 64), (48, 1536), (16, 96))
    for out_features, in_features in shapes:
        blocks, values = _blocks(qtype_name, out_features, in_features)
        assert gguf_matmul.serves(qtype, blocks, values.to(dtype))
        kernel_rows = gguf_matmul.kernel_blocks(qtype, blocks)
        # every tile size, and more rows than a tile: whole tiles plus a partial one
        for rows in [*range(1, gguf_matmul.TILE_ROWS + 1), 9, 13, 17]:
            x = torch.randn(rows, in_features).to(dtype)
            bias = torch.randn(out_features).to(dtype)
            got = gguf_matmul.quantized_linear(x, kernel_rows, qtype, out_features, bias)
            # the blocks' values exactly, against x (bfloat16: held to 2^-13 of each 32 values'
            # largest, then the output rounded to bfloat16)
            want = x.float() @ values.T + bias.float()  # [rows, out]
            assert got.dtype == dtype and got.shape == (rows, out_features)
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
            assert (got.float() - want).abs().max() <= tol * want.abs().max()
    x3 = torch.randn(2, 3, in_features).to(dtype)  # leading dims are rows too
    assert gguf_matmul.quantized_linear(x3, kernel_rows, qtype, out_features).shape == (
        2, 3, out_features)


@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
def test_outputs_that_are_not_whole_groups(qtype_name):
    """Weights are held in groups of 16 rows; a vocabulary like 32001 leaves a part group,
    padded with zero rows that are computed but never written (the op's output is exactly
    [rows, out_features]: a write past it would land in another allocation)."""
    qtype = gguf_matmul.QTYPES[qtype_name]
    in_features = 256
    for out_features in (1, 15, 17, 40):
        blocks, values = _blocks(qtype_name, out_features, in_features, seed=out_features)
        assert gguf_matmul.serves(qtype, blocks, values)
        kernel_rows = gguf_matmul.kernel_blocks(qtype, blocks)
        assert kernel_rows.shape[0] == -(-out_features // 16) * 16
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, in_features)
            bias = torch.randn(out_features)
            got = gguf_matmul.quantized_linear(x, kernel_rows, qtype, out_features, bias)
            want = x @ values.T + bias  # [rows, out]
            # relative to the terms' size: a single output may cancel down to near 0
            scale = (x.abs() @ values.abs().T).max()
            assert got.shape == (rows, out_features)
            assert (got - want).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
def test_uses_exactly_the_dequantized_values(qtype_name):
    """One-hot rows pick single weights: each must be dequantize's value to the bit (in steps
    of 16 rows, two tiles: a single row on 4-bit blocks takes the dot product by linearity,
    equal up to rounding, which test_matches_dequantize_then_matmul checks)."""
    # 1024 wide: 8 rows of x outgrow L1 and every type takes its widest path (output pairs)
    blocks, values = _blocks(qtype_name, 16, 1024, seed=1)
    picked = torch.eye(1024)  # [1024, 1024]: row i picks input column i
    kernel_rows = gguf_matmul.kernel_blocks(gguf_matmul.QTYPES[qtype_name], blocks)
    got = torch.cat([gguf_matmul.quantized_linear(picked[i:i + 16], kernel_rows,
                                                  gguf_matmul.QTYPES[qtype_name], 16)
                     for i in range(0, 1024, 16)])
    assert torch.equal(got, values.T)


@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
def test_integer_kernel_stays_near_float32_rounding(qtype_name):
    """The kernel multiplies x cut into int8 limbs (csrc/gguf_int_dot.h), to 2^-20 of
    each 32 values' largest: the result must stay within a few times float32's own rounding,
    also where a rare large value sets a block's scale."""
    blocks, values = _blocks(qtype_name, 64, 1536)
    qtype = gguf_matmul.QTYPES[qtype_name]
    kernel_rows = gguf_matmul.kernel_blocks(qtype, blocks)
    torch.manual_seed(0)
    for outlier in (1.0, 100.0):
        x = torch.randn(8, 1536) * torch.where(torch.rand(8, 1536) < 0.01, outlier, 1.0)
        exact = x.double() @ values.double().T  # [8, 64]
        scale = exact.abs().max()
        err = (gguf_matmul.quantized_linear(x, kernel_rows, qtype, 64).double() - exact).abs().max()
        dense_err = ((x @ values.T).double() - exact).abs().max()  # measured 3-5e-7 of scale
        assert err <= 5e-6 * scale, (err / scale, dense_err / scale)


def test_float32_matmul_precision_high_takes_two_limbs():
    """torch.set_float32_matmul_precision("high") lets float32 x be held to 2^-13 of each 32
    values' largest (two limbs), as bfloat16 x is: coarser than at "highest", within TF32's
    rounding (2^-11), which "high" allows on a GPU."""
    blocks, values = _blocks("Q4_1", 64, 1536)
    q41 = gguf_matmul.QTYPES["Q4_1"]
    kernel_rows = gguf_matmul.kernel_blocks(q41, blocks)
    x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ values.double().T
    errors = {}
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            got = gguf_matmul.quantized_linear(x, kernel_rows, q41, 64).double()
            errors[precision] = ((got - exact).abs().max() / exact.abs().max()).item()
    finally:
        torch.set_float32_matmul_precision(before)
    assert errors["highest"] <= 5e-6 < errors["high"] <= 2 ** -11, errors


def test_integer_kernel_passes_nan_and_inf_on():
    """x cut into limbs must not turn a NaN or inf into a finite result."""
    blocks, values = _blocks("Q4_1", 16, 256)
    q41 = gguf_matmul.QTYPES["Q4_1"]
    x = torch.randn(2, 256)
    x[0, 5], x[1, 100] = float("nan"), float("inf")
    got = gguf_matmul.quantized_linear(x, gguf_matmul.kernel_blocks(q41, blocks), q41, 16)
    assert not got.isfinite().any()


def test_what_it_refuses():
    blocks, values = _blocks("Q4_1", 16, 64)
    q41 = gguf_matmul.QTYPES["Q4_1"]
    assert not gguf_matmul.serves(q41, blocks, values[:, :32])  # blocks of another width
    assert not gguf_matmul.serves(q41, blocks[:4], values)  # other row count
    assert not gguf_matmul.serves(gguf_matmul.QTYPES["Q8_0"], blocks, values)  # other type
    assert not gguf_matmul.serves(11, blocks, values)  # a type the kernel does not read (Q3_K)
    # K-quant blocks hold 256 values: a width that is no multiple of it is refused
    k_blocks, k_values = _blocks("Q4_K", 16, 512)
    q4k = gguf_matmul.QTYPES["Q4_K"]
    assert gguf_matmul.serves(q4k, k_blocks, k_values)
    assert not gguf_matmul.serves(q4k, k_blocks[:, :216], k_values[:, :384])
    assert not gguf_matmul.serves(q41, blocks, values.half())  # a dtype the kernel lacks
    kernel_rows = gguf_matmul.kernel_blocks(q41, blocks)
    with pytest.raises(RuntimeError, match="no rows"):
        gguf_matmul.quantized_linear(torch.randn(0, 64), kernel_rows, q41, 16)
    with pytest.raises(ValueError, match="kernel layout"):  # the file's blocks, unconverted
        gguf_matmul.quantized_linear(torch.randn(1, 64), blocks, q41, 16)


def _ungroup(kernel: torch.Tensor, nblocks: int, block_bytes: int) -> torch.Tensor:
    """A weight held in groups of 16 rows back in rows: [rows, nblocks, block_bytes] (d, m, 16
    bytes of nibbles, and for 5-bit blocks 4 bytes of fifth bits (not undone here))."""
    groups = kernel.view(-1, nblocks, 16 * block_bytes)  # [group, block, bytes]
    d = groups[..., :64].reshape(-1, nblocks, 16, 4)  # [group, block, row, 4 bytes]
    m = groups[..., 64:128].reshape(-1, nblocks, 16, 4)
    # nibble vector j holds row c's bytes 4 j .. 4 j + 3 at 64 j + 4 c
    nibbles = groups[..., 128:384].reshape(-1, nblocks, 4, 16, 4).transpose(2, 3).reshape(
        -1, nblocks, 16, 16)
    rows = torch.cat([d, m, nibbles], dim=-1)  # [group, block, row, 24]
    return rows.transpose(1, 2).reshape(-1, nblocks, 24)


def test_kernel_layout_widens_4_bit_scales_once():
    """4-bit blocks become [float32 d][float32 m][nibbles] (m = -8 d for Q4_0), 24 bytes a
    block, interleaved in groups of 16 rows, and a Q4_K block 8 of them; K-quants become
    32-value blocks; Q8_0 blocks become float32 d and q + 128 in groups of 16 rows (the values
    of all are checked against dequantize by the tests above)."""
    for name, offset in (("Q4_0", 2), ("Q4_1", 4)):
        blocks, _ = _blocks(name, 32, 96)
        file_block = blocks.shape[1] // 3
        kernel = gguf_matmul.kernel_blocks(gguf_matmul.QTYPES[name], blocks)
        assert kernel.shape == (32, 3 * 24)
        got = _ungroup(kernel, 3, 24)  # [32 rows, 3 blocks, 24]
        raw = blocks.view(32, 3, file_block)
        d = raw[..., :2].contiguous().view(torch.float16).float()[..., 0]
        m = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if name == "Q4_1" \
            else -8 * d
        assert torch.equal(got[..., :4].contiguous().view(torch.float32)[..., 0], d)
        assert torch.equal(got[..., 4:8].contiguous().view(torch.float32)[..., 0], m)
        assert torch.equal(got[..., 8:], raw[..., offset:])
    q4k, _ = _blocks("Q4_K", 16, 512)  # 2 blocks of 256 a row -> 16 Q4_1-like blocks
    q4k_kernel = gguf_matmul.kernel_blocks(gguf_matmul.QTYPES["Q4_K"], q4k)
    assert q4k.shape == (16, 2 * 144) and q4k_kernel.shape == (16, 16 * 24)
    # Q5_K: 16 blocks of 28 bytes (5-bit values); Q6_K: 16 of 40 (int8 values, two scales)
    for name, file_bytes, kernel_bytes in (("Q5_K", 176, 28), ("Q6_K", 210, 40)):
        k_blocks, _ = _blocks(name, 16, 512)
        assert k_blocks.shape == (16, 2 * file_bytes)
        assert gguf_matmul.kernel_blocks(gguf_matmul.QTYPES[name], k_blocks).shape == (
            16, 16 * kernel_bytes)
    # Q8_0: float32 d, then q + 128 (unsigned), in groups of 16 rows
    q8, _ = _blocks("Q8_0", 16, 96)
    groups = gguf_matmul.kernel_blocks(gguf_matmul.QTYPES["Q8_0"], q8).view(3, 16 * 36)
    raw = q8.view(16, 3, 34)
    d = raw[..., :2].contiguous().view(torch.float16).float()[..., 0]  # [row, block]
    assert torch.equal(groups[:, :64].contiguous().view(torch.float32), d.T)
    q = groups[:, 64:].reshape(3, 8, 16, 4).transpose(1, 2).reshape(3, 16, 32)  # [block, row, 32]
    assert torch.equal(q.transpose(0, 1).int() - 128, raw[..., 2:].contiguous().view(torch.int8).int())
    with pytest.raises(ValueError, match="uint8"):
        gguf_matmul.kernel_blocks(gguf_matmul.QTYPES["Q4_1"], q8.float())
    with pytest.raises(ValueError, match="row_bytes"):  # rows of 3 Q8_0 blocks are no Q4_1 rows
        gguf_matmul.kernel_blocks(gguf_matmul.QTYPES["Q4_1"], q8)


def test_row_limits_cover_every_type_and_dtype():
    for qtype in gguf_matmul.QTYPES.values():
        assert 1 <= gguf_matmul.rows_worth_it(torch.float32, qtype) <= 64
        # 0 would be: the blocks never beat the bfloat16 weight
        assert 0 <= gguf_matmul.rows_worth_it(torch.bfloat16, qtype) <= 64
        assert gguf_matmul.rows_worth_it(torch.float16, qtype) == 0  # no kernel for float16
    assert gguf_matmul.rows_worth_it(torch.float32, 11) == 0  # Q3_K: not read by the kernel
