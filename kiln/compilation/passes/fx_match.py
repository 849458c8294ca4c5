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


_LINEAR_ARGS = ("x", "weight", "bias", "packed", "blocks", "plan")


def linear_arg(linear: fx.Node, name: str):
    """The IR op linear's argument `name`, positional or keyword (None when absent)."""
    i = _LINEAR_ARGS.index(name)
    return linear.args[i] if len(linear.args) > i else linear.kwargs.get(name)


def linear_bias(linear: fx.Node):
    return linear_arg(linear, "bias")


def linear_tail(linear: fx.Node) -> tuple:
    """(bias, packed, blocks, plan): the linear's arguments after its weight, for a fused op
    that ends in the same linear."""
    return tuple(linear_arg(linear, n) for n in _LINEAR_ARGS[2:])
