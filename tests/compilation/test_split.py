"""Splitting at the splitting ops: piece counts, shared consecutive ops, getitem, sizes, order."""
import operator

import torch
from torch import fx

from kiln.compilation.split import assign_pieces, split_graph

import toy_model  # noqa: F401  (registers the test splitting op)

OP = toy_model.SPLIT_OP
toy_model._LAYERS.update({f"l{i}": (2, 4) for i in range(3)})  # 2 heads of 4 on [T, 8]


def _layers_graph(num_layers: int) -> fx.GraphModule:
    def fn(x):
        for i in range(num_layers):
            out = torch.empty_like(x)
            torch.ops.kiln_test.toy_attention(x, x, x, out, f"l{i}")
            x = torch.relu(out) + 1
        return x * 2
    return fx.symbolic_trace(fn)


def test_n_layers_give_2n_plus_1_pieces():
    for n in (1, 2, 3):
        _, items = split_graph(_layers_graph(n), [OP])
        assert len(items) == 2 * n + 1
        assert sum(not it.is_splitting_graph for it in items) == n + 1
        assert [it.is_splitting_graph for it in items] == [i % 2 == 1 for i in range(2 * n + 1)]


def test_split_keeps_numerics():
    gm = _layers_graph(2)
    x = torch.randn(4, 8)
    expected = gm(x)
    split_gm, _ = split_graph(gm, [OP])
    torch.testing.assert_close(split_gm(x), expected)


def test_consecutive_splitting_ops_share_a_piece():
    def fn(x):
        a, b = torch.empty_like(x), torch.empty_like(x)
        torch.ops.kiln_test.toy_attention(x, x, x, a, "l0")
        torch.ops.kiln_test.toy_attention(x, x, x, b, "l1")
        return a + b
    _, items = split_graph(fx.symbolic_trace(fn), [OP])
    assert [it.is_splitting_graph for it in items] == [False, True, False]


def test_getitem_stays_with_producer():
    def fn(x):
        parts = torch.split(x, 2)
        out = torch.empty_like(parts[0])
        torch.ops.kiln_test.toy_attention(parts[0], parts[0], parts[0], out, "l0")
        return out + parts[1]
    gm = fx.symbolic_trace(fn)
    piece_of, _ = assign_pieces(gm.graph, [OP])
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            assert piece_of[node] == piece_of[node.args[0]]


def test_size_node_moves_to_its_user_piece():
    graph = fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
    out = graph.call_function(torch.empty_like, (x,))
    graph.call_function(torch.ops.kiln_test.toy_attention.default, (x, x, x, out, "l0"))
    view = graph.call_function(torch.ops.aten.view.default, (out, [size, -1]))
    graph.output(view)
    split_gm, items = split_graph(fx.GraphModule(torch.nn.Module(), graph), [OP])
    assert len(items) == 3
    last = items[-1].graph
    assert any(n.target is torch.ops.aten.sym_size.int for n in last.graph.nodes)
    assert split_gm(torch.randn(3, 8)).shape == (3, 8)


def test_every_piece_returns_a_tuple():
    """Also a piece with one output (torch 2.11's split_module returns it bare): the stitching
    graph takes element 0."""
    gm = _layers_graph(1)
    x = torch.randn(4, 8)
    expected = gm(x)
    split_gm, items = split_graph(gm, [OP])
    returned = [next(n for n in reversed(it.graph.graph.nodes) if n.op == "output").args[0]
                for it in items]
    assert all(isinstance(r, tuple) for r in returned)
    assert any(len(r) == 1 for r in returned)
    torch.testing.assert_close(split_gm(x), expected)
