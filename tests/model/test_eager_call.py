"""A linear layer's IR call, looked up once for eager forwards (kiln/model/layers/eager_call.py):
dropped whenever what it reads changes (attributes, `.to()`), never seen by Dynamo, whose graph
still takes the parameters and buffers as inputs."""
import torch
import torch.nn.functional as F

from kiln import ir
from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear, RowParallelLinear
from kiln.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.native import linear_op


def _layer(bias=True):
    torch.manual_seed(0)
    layer = ReplicatedLinear(32, 24, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer


def _held_call(layer):
    return layer.__dict__.get("_eager_call")


def test_the_call_is_built_once_and_dropped_when_what_it_reads_changes():
    layer, x = _layer(), torch.randn(5, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    call = _held_call(layer)
    assert call is not None and call[0] is ir.linear and call[1][0] is layer.weight
    layer(x)
    assert _held_call(layer) is call  # not rebuilt
    new = torch.nn.Parameter(torch.randn(24, 32), requires_grad=False)
    layer.weight = new
    assert _held_call(layer) is None
    torch.testing.assert_close(layer(x), F.linear(x, new, layer.bias))
    layer.bias = None
    torch.testing.assert_close(layer(x), F.linear(x, new))
    if cpu_gemm.prepack_for_cpu(layer):  # sets cpu_packed and cpu_plan: the packed copy is read
        before = linear_op.path_counts()["packed"]
        torch.testing.assert_close(layer(x), F.linear(x, new), rtol=1e-5, atol=1e-5)
        assert linear_op.path_counts()["packed"] == before + 1


def test_to_another_dtype_drops_the_call():
    layer, x = _layer(), torch.randn(3, 32)
    layer(x)
    layer.to(torch.bfloat16)
    assert _held_call(layer) is None
    out = layer(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x.bfloat16(), layer.weight, layer.bias))


def test_a_row_parallel_rank_but_the_first_adds_no_bias():
    first, other = (RowParallelLinear(32, 24, bias=True, tp_rank=r, tp_size=2) for r in (0, 1))
    assert first._build_call()[1][1] is first.bias
    assert other._build_call()[1][1] is None


def test_a_tied_head_reads_the_embedding_after_tying():
    embedding, head = VocabParallelEmbedding(40, 16, 0, 1), ParallelLMHead(40, 16, 0, 1)
    torch.nn.init.normal_(embedding.weight)
    hidden = torch.randn(2, 16)
    head.compute_logits(hidden)
    head.tie_weights(embedding)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ embedding.weight.T)


def test_dynamo_lifts_the_parameters_and_buffers_not_the_held_call():
    layer, x = _layer(), torch.randn(6, 32)
    cpu_gemm.prepack_for_cpu(layer)
    layer(x)  # the eager call is held now
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(n.name for n in gm.graph.nodes if n.op == "placeholder")
        return gm

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)
    names = " ".join(inputs)
    assert "weight" in names and "bias" in names and "_eager_call" not in names
    if layer.cpu_packed is not None:
        assert "cpu_packed" in names and "cpu_plan" in names


def test_weights_reloaded_in_place_or_assigned_are_read():
    """Reloads that keep the parameter (copy_, .data =) reach the held call through it; one that
    replaces it (load_state_dict(assign=True) sets the attribute) drops the call."""
    layer, x = _layer(), torch.randn(3, 32)
    layer(x)
    w2, w3, b2 = torch.randn(24, 32), torch.randn(24, 32), torch.randn(24)
    with torch.no_grad():
        layer.weight.copy_(w2)
    torch.testing.assert_close(layer(x), F.linear(x, w2, layer.bias))
    layer.weight.data = w3
    torch.testing.assert_close(layer(x), F.linear(x, w3, layer.bias))
    layer.load_state_dict({"weight": w2, "bias": b2}, assign=True)
    assert _held_call(layer) is None
    torch.testing.assert_close(layer(x), F.linear(x, w2, b2))
