"""oneDNN-packed CPU GEMMs: same numbers as aten's linear, and no stale packing after a free."""
import gc

import pytest
import torch
import torch.nn.functional as F

from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear
from kiln.native import gemv

pytestmark = pytest.mark.skipif(
    not cpu_gemm.cpu_packing_available(torch.device("cpu"), torch.float32),
    reason="oneDNN packing needs an x86 CPU build of torch")


def _packed_layer(out_features=48, in_features=32, seed=0):
    torch.manual_seed(seed)
    layer = ReplicatedLinear(in_features, out_features, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    assert cpu_gemm.prepack_for_cpu(layer) == 1 and layer.use_packed_gemm
    return layer


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_matches_dense(rows):
    layer = _packed_layer()
    x = torch.randn(rows, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_packed_copy_is_forgotten_with_its_weight():
    layer = _packed_layer()
    ptr = layer.weight.data_ptr()
    assert ptr in cpu_gemm._PACKED
    del layer
    gc.collect()
    assert ptr not in cpu_gemm._PACKED  # a new weight at this address must not find it


def test_packed_op_traces_whole_graph_under_dynamo():
    # fullgraph=True fails if the op (fake impl included) breaks the trace.
    layer = _packed_layer()
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    x = torch.randn(5, 32)
    torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gemv.available(), reason="no C compiler: the GEMV kernel cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_one_or_two_rows_take_the_gemv_kernel(monkeypatch, dtype, rows):
    layer = _packed_layer(out_features=200, in_features=96).to(dtype)
    cpu_gemm.prepack_for_cpu(layer)
    x = torch.randn(rows, 96).to(dtype)
    calls, real = [], gemv.skinny_linear
    monkeypatch.setattr(gemv, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    got = layer(x)
    assert calls, "the GEMV kernel was not used"
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16 output keeps 8 mantissa bits
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    assert got.dtype == dtype and got.shape == (rows, 200)
