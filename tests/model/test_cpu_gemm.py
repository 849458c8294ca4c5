"""oneDNN-packed CPU GEMMs, the GEMV kernel and GGUF blocks: same numbers as aten's linear, each
path taken where it pays, and what picks it held by the layer (its buffers), not by the weight."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear
from kiln.native import gemv, gguf_matmul, linear_op

pytestmark = pytest.mark.skipif(
    not cpu_gemm.cpu_packing_available(torch.device("cpu"), torch.float32),
    reason="oneDNN packing needs an x86 CPU build of torch")


def _packed_layer(out_features=48, in_features=32, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = ReplicatedLinear(in_features, out_features, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.to(dtype)
    assert cpu_gemm.prepack_for_cpu(layer) == 1 and cpu_gemm.held(layer).packed
    return layer


def _layer_of(weight: torch.Tensor) -> ReplicatedLinear:
    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    layer.weight.data.copy_(weight)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_matches_dense(rows):
    layer = _packed_layer()
    x = torch.randn(rows, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def _paths_taken(call) -> list[str]:
    """The paths kiln::linear took during call()."""
    before = linear_op.path_counts()
    call()
    return [p for p, n in linear_op.path_counts().items() if n > before[p] for _ in
            range(n - before[p])]


def test_the_packed_copy_is_the_layers_and_only_its_calls_take_it():
    layer = _packed_layer()
    # buffers, not saved: a checkpoint of the layer is its weight and bias only
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert {n for n, _ in layer.named_buffers()} == {"cpu_packed", "cpu_plan"}
    x = torch.randn(40, 32)
    assert _paths_taken(lambda: layer(x)) == ["packed"]
    # The same weight without the layer's forms (a view, a copy): the dense path.
    w = layer.weight.detach()
    for other in (w[:24], w.clone()):
        want = F.linear(x, other)
        assert _paths_taken(lambda other=other, want=want: torch.testing.assert_close(
            torch.ops.kiln.linear_native(x, other), want, rtol=1e-5, atol=1e-5)) == ["dense"]


def test_tied_weights_share_one_packed_copy():
    a = _packed_layer()
    b = ReplicatedLinear(32, 48, bias=True)
    b.weight = a.weight
    model = torch.nn.ModuleList([a, b])
    assert cpu_gemm.prepack_for_cpu(model) == 2
    assert a.cpu_packed is b.cpu_packed


def test_a_packed_copy_of_another_dtype_is_not_read():
    layer = _packed_layer()
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    w, bias = layer.weight.to(torch.bfloat16), layer.bias.to(torch.bfloat16)
    assert _paths_taken(lambda: torch.ops.kiln.linear_native(
        x, w, bias, layer.cpu_packed, layer.cpu_plan)) == ["dense"]


def test_packed_op_traces_whole_graph_under_dynamo():
    # fullgraph=True fails if the op (fake impl included) breaks the trace.
    layer = _packed_layer()
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    x = torch.randn(5, 32)
    got = []
    # the packed copy is a graph input like the weight, and the compiled call takes it
    assert _paths_taken(lambda: got.append(compiled(x))) == ["packed"]
    torch.testing.assert_close(got[0], F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gemv.available(), reason="no C compiler: the GEMV kernel cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_one_or_two_rows_take_the_gemv_kernel(monkeypatch, dtype, rows):
    layer = _packed_layer(out_features=200, in_features=96, dtype=dtype)
    x = torch.randn(rows, 96).to(dtype)
    got = None

    def call():
        nonlocal got
        got = layer(x)
    assert _paths_taken(call) == ["gemv"]
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16 output keeps 8 mantissa bits
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    assert got.dtype == dtype and got.shape == (rows, 200)


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_blocks_take_the_few_row_steps_they_win(monkeypatch, dtype):
    import gguf
    import numpy as np

    q8 = gguf.GGMLQuantizationType.Q8_0
    torch.manual_seed(0)
    blocks = gguf.quants.quantize(torch.randn(48, 64).numpy(), q8)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, q8).reshape(48, 64).copy())
    layer = ReplicatedLinear(64, 48, bias=True).to(dtype)
    layer.weight.data.copy_(values)  # the float weight the blocks were dequantized into
    torch.nn.init.normal_(layer.bias)
    assert cpu_gemm.prepack_for_cpu(layer) == 1
    assert cpu_gemm.attach_gguf_blocks(layer, gguf_matmul.QTYPES["Q8_0"],
                                       torch.from_numpy(np.ascontiguousarray(blocks)))
    limit = gguf_matmul.rows_worth_it(dtype, gguf_matmul.QTYPES["Q8_0"])
    assert cpu_gemm.held(layer).block_rows == limit
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: its rounding of the weights
    paths = []
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64).to(dtype)
        want = x.float() @ values.T + layer.bias.float()
        paths += _paths_taken(lambda x=x, want=want: torch.testing.assert_close(
            layer(x).float(), want, rtol=tol, atol=tol * 8))
    assert paths == ["blocks", "blocks", "packed"]  # more rows than pay off take the dense ones


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_float32_matmul_precision_at_load_sets_the_blocks_limbs():
    from gguf_blocks import quantized_blocks

    q41 = gguf_matmul.QTYPES["Q4_1"]
    before = torch.get_float32_matmul_precision()
    try:
        for precision, limbs in (("highest", 3), ("high", 2), ("medium", 2)):
            torch.set_float32_matmul_precision(precision)
            weight = torch.randn(16, 64)
            blocks = torch.from_numpy(quantized_blocks(weight.numpy(), "Q4_1"))
            layer = _layer_of(weight)
            assert cpu_gemm.attach_gguf_blocks(layer, q41, blocks)
            assert cpu_gemm.held(layer).limbs == limbs
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_blocks_that_never_pay_in_a_dtype_are_not_kept(monkeypatch):
    import gguf

    from gguf_blocks import quantized_blocks

    q5k = gguf_matmul.QTYPES["Q5_K"]
    # A type whose blocks lose to the dense weight in bfloat16 at every row count (Q5_K's were,
    # before the kernel ran it as 32-value blocks)
    monkeypatch.setitem(gguf_matmul._ROWS_WORTH_IT["Q5_K"], torch.bfloat16, 0)
    # uncached, so the patched table is read (and no cached answer outlives the test)
    monkeypatch.setattr(gguf_matmul, "rows_worth_it", gguf_matmul.rows_worth_it.__wrapped__)
    assert gguf_matmul.rows_worth_it(torch.bfloat16, q5k) == 0 < gguf_matmul.rows_worth_it(
        torch.float32, q5k)
    blocks = quantized_blocks(np.zeros((16, 256), dtype=np.float32), "Q5_K")
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_K).reshape(16, 256)
    for dtype, kept in ((torch.float32, True), (torch.bfloat16, False)):
        layer = _layer_of(torch.from_numpy(values.copy()).to(dtype))
        assert cpu_gemm.attach_gguf_blocks(layer, q5k, torch.from_numpy(blocks)) is kept
        assert cpu_gemm.held(layer).blocks is kept


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_blocks_not_in_the_kernel_layout_are_never_read():
    """The kernel reads blocks without bounds: the file's 20-byte Q4_1 blocks (the kernel reads
    24), or blocks of another shape, must not get through; the call takes the dense weight."""
    from gguf_blocks import quantized_blocks

    q41 = gguf_matmul.QTYPES["Q4_1"]
    weight = torch.randn(16, 64)
    blocks = torch.from_numpy(quantized_blocks(weight.numpy(), "Q4_1"))  # [16, 2 * 20]
    plan = torch.tensor([0, 8, 3])
    x = torch.randn(2, 64)
    for wrong in (blocks, gguf_matmul.kernel_blocks(q41, blocks)[:, :-1].contiguous()):
        assert _paths_taken(lambda wrong=wrong: torch.ops.kiln.gguf_linear_native(
            x, wrong, q41, 16, None, weight, None, plan)) == ["dense"]
        with pytest.raises(ValueError, match="no dense weight"):  # nothing else to read
            torch.ops.kiln.gguf_linear_native(x, wrong, q41, 16)
    good = gguf_matmul.kernel_blocks(q41, blocks)
    assert _paths_taken(lambda: torch.ops.kiln.gguf_linear_native(
        x, good, q41, 16, None, weight, None, plan)) == ["blocks"]


def test_native_linear_refuses_tensors_not_on_the_cpu():
    """A meta x or weight (a let-go dense copy) is an error naming the device, never a read of a
    null pointer."""
    w = torch.randn(16, 64)
    plan = torch.tensor([0, 0, 3])
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    with pytest.raises(ValueError, match=r"x \(meta\) .* must be CPU tensors"):
        torch.ops.kiln.linear_native(torch.randn(2, 64, device="meta"), w, None, packed, plan)
