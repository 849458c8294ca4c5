"""Post-grad pass, after the fusions: each IR op node becomes its chosen implementation (the
engine's `Selection`, the one eager forwards are bound to): a native kernel's torch op, or the
plain-torch reference traced and inlined, which Inductor then fuses with its neighbours.

`lowered` records, process-wide, the providers every op was lowered to (what tests compare with
the eager binding); an implementation that does not support a node's arguments falls back to
the reference there, recorded as such.
"""
import contextlib
from collections import Counter

from torch import fx

from kiln import ir
from kiln.compilation.passes.fx_match import fake_value
from kiln.compilation.passes.pass_manager import KilnInductorPass
from kiln.ir.op import resolved

# (op, provider) -> nodes lowered to it, process-wide ("torch (fallback)" where unsupported)
lowered: Counter = Counter()
# attention is a splitting op: its implementation is the layers' backend, not a graph node
_NOT_LOWERED = ("unified_attention",)


def _inline_reference(graph: fx.Graph, node: fx.Node, op: ir.IrOp) -> None:
    """Replace `node` by `op.reference` traced on its arguments' fake values (Inductor's
    decompositions applied): tensor arguments stay graph inputs, the rest are constants."""
    from torch._dynamo.utils import detect_fake_mode
    from torch._inductor.pattern_matcher import fwd_only

    args = list(node.args)
    slots = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]

    def reference(*tensors):
        full = list(args)
        for i, t in zip(slots, tensors):
            full[i] = t
        return op.reference(*full)

    example = [args[i].meta["val"] for i in slots]
    with detect_fake_mode(example) or contextlib.nullcontext():
        traced = fwd_only(reference, example)
    env = dict(zip([n for n in traced.graph.nodes if n.op == "placeholder"],
                   [args[i] for i in slots]))
    out = None
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = fx.map_arg(n.args[0], env.__getitem__)
                break
            if n.op != "call_function":
                raise RuntimeError(f"the reference of {op.name} traced to a {n.op} node; it must "
                                   "be plain torch calls on its arguments")
            env[n] = graph.node_copy(n, env.__getitem__)
    if isinstance(out, (tuple, list)):  # its outputs are read through getitem nodes
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


class LowerIrOps(KilnInductorPass):
    def __init__(self, selection: ir.Selection):
        self.selection = selection

    def factors(self) -> dict:
        return {"chosen": self.selection.as_dict()}

    def __call__(self, graph: fx.Graph) -> None:
        by_packet = {op.packet: op for name, op in ir.REGISTRY.items() if name not in _NOT_LOWERED}
        chosen = self.selection.as_dict()
        for node in list(graph.nodes):
            op = by_packet.get(node.target) if node.op == "call_function" else None
            if op is None:
                continue
            provider = chosen[op.name]
            impl = op.impls[provider]
            if provider != "torch" and not op.supported_by(provider,
                                                           *map(_value, node.args)):
                impl, provider = op.impls["torch"], "torch (fallback)"
            if impl.graph_op is not None:
                node.target = resolved(impl.graph_op)
            else:
                _inline_reference(graph, node, op)
            lowered[op.name, provider] += 1
            self.matched += 1
        graph.lint()


def _value(arg):
    return fake_value(arg) if isinstance(arg, fx.Node) else arg


def lowered_providers() -> dict[str, set[str]]:
    """op -> the providers its nodes were lowered to so far in this process."""
    out: dict[str, set[str]] = {}
    for (op, provider), n in lowered.items():
        if n:
            out.setdefault(op, set()).add(provider)
    return out


def reset_record() -> None:
    lowered.clear()

