"""oneDNN-packed CPU GEMMs: same numbers as aten's linear, and no stale packing after a free."""
import gc

import pytest
import torch
import torch.nn.functional as F

from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear

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
