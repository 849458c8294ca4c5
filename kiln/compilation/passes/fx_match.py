"""Small helpers the fusion passes use to recognise a pattern in a post-grad FX graph."""
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
    values = [fake_value(n) for n in nodes]
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in values)


def linear_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's kiln::linear calls (none where the model's layers did not register it)."""
    packet = getattr(torch.ops.kiln, "linear", None)
    return [] if packet is None else [n for n in graph.nodes if is_call(n, packet.default)]


def linear_bias(linear: fx.Node):
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
