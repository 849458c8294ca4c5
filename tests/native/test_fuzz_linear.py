"""kiln::linear and kiln::gguf_linear (csrc/linear_op.cpp) against float64 references,
adversarially: every path (GGUF blocks, GEMV, oneDNN packed) across row counts and output widths
at their boundaries, strided x, bias shapes, thread counts; and a weight's views, which hold none
of its forms."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from linear_calls import run_native

from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear
from kiln.native import gemv, gguf_matmul, linear_op

from gguf_blocks import quantized_blocks

pytestmark = pytest.mark.skipif(not linear_op.available(), reason="no C++ compiler")


def _packed_layer(weight: torch.Tensor) -> ReplicatedLinear:
    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    layer.weight.data.copy_(weight)
    assert cpu_gemm.prepack_for_cpu(layer) == 1
    assert cpu_gemm.held(layer).gemv_rows == (gemv.MAX_ROWS if gemv.serves(weight, None) else 0)
    return layer


def _path_of(call):
    before = linear_op.path_counts()
    out = call()
    after = linear_op.path_counts()
    return out, [p for p in after if after[p] != before[p]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_view_of_a_square_weight_is_not_the_weight(dtype):
    """w.t() of a square weight shares its address, storage, shape and dtype: given w's forms
    (its packed copy, its plan of GEMV over w's rows) the op must still compute with w.t()."""
    layer = _packed_layer(torch.randn(64, 64).to(dtype))
    w = layer.weight
    for rows in (1, 2, 5):
        x = torch.randn(rows, 64).to(dtype)
        got = torch.ops.kiln.linear_native(x, w.t())
        torch.testing.assert_close(got.float(), (x.float() @ w.float()), rtol=2e-2, atol=2e-2)
        got = run_native(layer, x)  # w itself takes its own path
        torch.testing.assert_close(got.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bias_shapes_follow_f_linear(rows):
    layer = _packed_layer(torch.randn(48, 32))
    w = layer.weight
    x = torch.randn(rows, 32)
    for bias in (torch.randn(1), torch.randn(96)[::2]):  # broadcast; strided
        got = run_native(layer, x, bias)
        want = F.linear(x.double(), w.double(), bias.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):  # a bias of the wrong length is an error, not a read
        run_native(layer, x, torch.randn(3))  # past its end


def _blocks(qtype_name: str, out_features: int, in_features: int, seed: int):
    values = np.random.default_rng(seed).standard_normal((out_features, in_features))
    blocks = quantized_blocks(values, qtype_name, seed)
    deq = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype_name))
    return (torch.from_numpy(np.ascontiguousarray(blocks)),
            torch.from_numpy(deq.astype(np.float32).reshape(out_features, in_features).copy()))


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
def test_every_path_at_its_boundaries(qtype_name):
    """Rows crossing GEMV's, the blocks' and a tile's limits, output widths around the 16-row
    groups, strided x, bias or none: each path within float32's (bfloat16's) bound of the exact
    product of the values it holds, and bit-identical on 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    in_features = 256
    threads = torch.get_num_threads()
    for out_features in (1, 17, 48):
        blocks, values = _blocks(qtype_name, out_features, in_features, out_features)
        for dtype in (torch.float32, torch.bfloat16):
            layer = _packed_layer(values.to(dtype))
            cpu_gemm.attach_gguf_blocks(layer, gguf_matmul.QTYPES[qtype_name], blocks)
            w = layer.weight
            for rows in (1, 2, 3, 8, 9, 17, 49, 65):
                wide = torch.randn(rows, in_features + 7, generator=g).to(dtype)
                x = wide[:, 5:5 + in_features]  # a column slice at an offset
                bias = torch.randn(out_features, generator=g).to(dtype) if rows % 2 else None
                got, path = _path_of(lambda x=x, bias=bias, layer=layer:
                                     run_native(layer, x, bias))
                held = (values if path == ["blocks"] else w.float()).double()
                exact = x.double() @ held.T + (bias.double() if bias is not None else 0)
                terms = x.double().abs() @ held.abs().T + (
                    bias.double().abs() if bias is not None else 0)
                tol = 4e-6 if dtype == torch.float32 else 2 ** -7
                assert ((got.double() - exact).abs() <= tol * terms + 1e-30).all(), (
                    out_features, dtype, rows, path)
                torch.set_num_threads(1)
                try:
                    single = run_native(layer, x, bias)
                finally:
                    torch.set_num_threads(threads)
                assert torch.equal(single, got), (out_features, dtype, rows, path)


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("qtype_name", sorted(gguf_matmul.QTYPES))
def test_gguf_blocks_keep_rows_of_tiny_values(qtype_name):
    """A row of x whose values are all tiny (1e-30, or subnormal) is still float32 math: its
    outputs are tiny too, not zero (x held in int8 limbs under a power-of-two scale must not
    lose the row to the scale's range). Rows of any size sit next to each other in one call."""
    qtype = gguf_matmul.QTYPES[qtype_name]
    blocks, values = _blocks(qtype_name, 17, 512, seed=3)
    kernel_rows = gguf_matmul.kernel_blocks(qtype, blocks)
    scales = torch.tensor([1e-30, 1.0, 1e-38, 3e-39, 1e-20, 1e30, 1e-44, 0.0, 2e-36])
    x = torch.randn(len(scales), 512, generator=torch.Generator().manual_seed(0)) * scales[:, None]
    bias = torch.randn(17)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        exact = xd.double() @ values.double().T  # [rows, 17]
        terms = xd.double().abs() @ values.double().abs().T
        got = gguf_matmul.quantized_linear(xd, kernel_rows, qtype, 17).double()
        tol = 4e-6 if dtype == torch.float32 else 2 ** -7
        # 1e-44's products are below float32's subnormals' spacing: only they may round off
        within = (got - exact).abs() <= tol * terms + 1e-44  # False for a NaN too
        assert within.all(), (dtype, (~within).nonzero()[:4])
        b = bias.to(dtype)
        got = gguf_matmul.quantized_linear(xd, kernel_rows, qtype, 17, b).double()
        within = (got - (exact + b.double())).abs() <= tol * (terms + b.double().abs())
        assert within.all(), (dtype, (~within).nonzero()[:4])
