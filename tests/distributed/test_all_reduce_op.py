"""The TP all-reduce is the IR op `kiln::all_reduce`: one node in a traced graph, left in
place by the IR lowering pass (what a later all-reduce + RMSNorm fusion matches)."""
import torch

from kiln import ir
from kiln.compilation.passes.lower_ir import LowerIrOps


def _captured_graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_all_reduce_is_one_node_and_lowering_keeps_it():
    def row_parallel_tail(x, w):
        return ir.all_reduce(x @ w.t(), "tp") + 1.0

    x, w = torch.randn(3, 8), torch.randn(4, 8)
    gm = _captured_graph(row_parallel_tail, x, w)
    assert _targets(gm.graph).count(ir.all_reduce.packet) == 1
    LowerIrOps(ir.resolve({}, "cpu", torch.float32))(gm.graph)
    assert _targets(gm.graph).count(ir.all_reduce.packet) == 1
    # in a group of one the op is the identity (a copy)
    torch.testing.assert_close(ir.all_reduce(x, "tp"), x)
