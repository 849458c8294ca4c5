"""Small helpers the passes use to find IR ops in a post-grad FX graph."""
import operator

import torch
from torch import fx


def is_call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def fake_value(node):
    """The node's example value (a FakeTensor for a tensor), or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def all_float32(*nodes) -> bool:
    """Every node a float32 tensor (None, an absent bias, counts as one)."""
    values = [fake_value(n) for n in nodes if n is not None]
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in values)


def calls(graph: fx.Graph, packet) -> list[fx.Node]:
    return [n for n in graph.nodes if is_call(n, packet)]


def getitem_of(node, source: fx.Node, index: int) -> bool:
    """Whether node is source[index] (an output of a multi-output op)."""
    return is_call(node, operator.getitem) and node.args == (source, index)


def call_args(node: fx.Node) -> tuple:
    """node's arguments in its op's schema order, positional or keyword, defaults filled in."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        else:
            out.append(node.kwargs.get(arg.name, arg.default_value))
    return tuple(out)


def arg_named(node: fx.Node, name: str):
    """node's argument `name` (None when its op has none or it is absent)."""
    names = [a.name for a in node.target._schema.arguments]
    return call_args(node)[names.index(name)] if name in names else None


def linear_operands(linear: fx.Node) -> tuple:
    """What a linear IR op node multiplies with besides x whose dtype matters: its dense weight
    (gguf_linear's optional copy) and bias."""
    return arg_named(linear, "weight"), arg_named(linear, "bias")


def linear_calls(graph: fx.Graph, ops) -> list[fx.Node]:
    """The nodes of graph calling one of the linear IR ops `ops`, in graph order."""
    packets = {op.packet for op in ops}
    return [n for n in graph.nodes if n.op == "call_function" and n.target in packets]
