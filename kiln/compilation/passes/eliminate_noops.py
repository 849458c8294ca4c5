"""Post-grad pass `eliminate_noops` (vLLM's name): views, reshapes and expands to the shape a
tensor already has, slices that keep every element, and copies (clone, a same-dtype _to_copy)
of a value nothing mutates are replaced by their input.

Shapes compare as written (the same symbol or number per dim), never by asking the shape
environment, so the pass adds no guards.
"""
import torch
from torch import fx

from kiln.compilation.passes.fx_match import fake_value
from kiln.compilation.passes.pass_manager import KilnInductorPass

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.expand.default, aten.alias.default)
_COPIES = (aten.clone.default, aten._to_copy.default)


def _same_shape(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim()
            and all(str(x) == str(y) for x, y in zip(a.shape, b.shape)))


def _mutated(node: fx.Node) -> bool:
    """Whether an op writes to node's value (or it leaves the graph, where aliasing matters)."""
    for user in node.users:
        if user.op == "output":
            return True
        schema = getattr(user.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def is_noop(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = fake_value(node.args[0]), fake_value(node)
    if not _same_shape(src, out):
        return False
    if node.target in _RESHAPES:
        return True
    if node.target == aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        return start in (None, 0) and step == 1
    if node.target in _COPIES:
        kw = dict(node.kwargs)
        kw.pop("memory_format", None)  # a changed layout shows in the strides below
        if node.target == aten._to_copy.default:
            kw.pop("non_blocking", None)
            if (kw.pop("dtype", src.dtype), kw.pop("device", src.device),
                    kw.pop("layout", torch.strided)) != (src.dtype, src.device, torch.strided):
                return False
        if kw or out.stride() != src.stride():
            return False
        return (node.args[0].op != "placeholder" and not _mutated(node)
                and not _mutated(node.args[0]))
    return False


class EliminateNoops(KilnInductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                self.matched += 1
        graph.lint()
