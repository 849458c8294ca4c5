"""Post-grad pass `reinplace_ir_ops`, after the lowering: a lowered IR op whose implementation has
an in-place form (kiln/ir/op.py `InplaceVariant`) becomes that form where the graph owns what it
overwrites, and the op's outputs become the overwritten inputs: no new buffer, no copy.

Owned means: an intermediate (not a graph input or constant, nor a view of one), laid out as the
kernel writes it, and nothing reads the overwritten elements after the op (the base and every
view of it, except column ranges provably disjoint, such as V beside the Q and K a rotary
rewrites in one QKV output). The in-place call takes the functional node's place, so every
reader of the old values comes before it in graph order, which Inductor's scheduler keeps
(buffer mutations order its kernels; its post-grad pattern passes stop at mutations). Inductor's
own reinplacing would not do this: it clones a view whose base has another live view.
"""
import operator

import torch
from torch import fx

from kiln import ir
from kiln.compilation.passes.fx_match import fake_value
from kiln.compilation.passes.pass_manager import KilnInductorPass
from kiln.ir.op import resolved

aten = torch.ops.aten


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


# Views whose schema does not say so: _unsafe_view shares its input's storage (eager and
# Inductor alike), though its return carries no alias annotation.
_UNANNOTATED_VIEWS = (aten._unsafe_view.default,)


def _returns_alias(node: fx.Node) -> bool:
    """Whether node is a view op (by schema: a return that aliases an input, written by none)."""
    if node.op == "call_function" and node.target in _UNANNOTATED_VIEWS:
        return True
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable
            and any(r.alias_info is not None for r in schema.returns))


def _is_view(node: fx.Node) -> bool:
    return _returns_alias(node) or (node.target is operator.getitem
                                    and isinstance(node.args[0], fx.Node)
                                    and _returns_alias(node.args[0]))


def _last_dim(node, dim) -> bool:
    val = fake_value(node)
    return isinstance(dim, int) and isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _split_columns(split: fx.Node, index: int):
    """The [lo, hi) columns the index-th piece of a split node covers, None unless the split
    is along the last dim in sizes known at compile time."""
    if split.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None  # unbind and other multi-output views (their args differ)
    sizes = split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not _last_dim(split.args[0], dim):
        return None
    if split.target == aten.split.Tensor:  # pieces of `sizes` columns each
        sizes = [sizes] * (index + 1) if isinstance(sizes, int) else None
    if not (isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes)):
        return None
    lo = sum(sizes[:index])
    return lo, lo + sizes[index]


def _slice_columns(node: fx.Node):
    base = node.args[0]
    if not (node.target == aten.slice.Tensor and _last_dim(base, node.args[1])):
        return None
    start, end, step = (list(node.args[2:5]) + [0, None, 1][len(node.args) - 2:])[:3]
    width, start = fake_value(base).shape[-1], 0 if start is None else start
    if not (step == 1 and isinstance(start, int) and 0 <= start and isinstance(width, int)
            and (end is None or isinstance(end, int) and end >= 0)):
        return None
    return start, width if end is None else min(end, width)


def _view_step(node: fx.Node):
    """(the node whose storage node views, node's [lo, hi) columns of its last dim, None when
    not known), or None when node is no view."""
    if not _is_view(node):
        return None
    if node.target is operator.getitem:
        split, index = node.args
        return split.args[0], _split_columns(split, index)
    return node.args[0], _slice_columns(node)


_UNKNOWN = "unknown"


def _base_of(node: fx.Node):
    """(the node owning node's storage, node's [lo, hi) columns of its last dim; None: all of
    it; _UNKNOWN: not known)."""
    region = None
    while (step := _view_step(node)) is not None:
        node, cols = step
        if not isinstance(node, fx.Node):
            return None, _UNKNOWN
        if cols is None or region == _UNKNOWN:
            region = _UNKNOWN
        elif region is None:
            region = cols
        else:
            region = (cols[0] + region[0], cols[0] + region[1])
    return node, region


def _overlap(a, b) -> bool:
    if a is None or b is None or _UNKNOWN in (a, b):
        return True
    return a[0] < b[1] and b[0] < a[1]


# Namespaces whose schemas are trusted to say when an output aliases an input.
_TRUSTED = ("aten", "kiln")


def _owned(base: fx.Node) -> bool:
    """An intermediate a functional op made (not an input, a constant, or a mutated value)."""
    if base.op != "call_function":
        return False
    if base.target is operator.getitem:
        base = base.args[0]
    schema = _schema(base)
    return (schema is not None and not schema.is_mutable
            and schema.name.split("::")[0] in _TRUSTED)


def _aliases(base: fx.Node) -> list[fx.Node]:
    """base and every node viewing its storage, through chains of view ops."""
    out, todo = [], [base]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(u for u in node.users if _is_view(u))
    return out


def _read_after(base: fx.Node, region, node: fx.Node, order: dict) -> bool:
    """Whether anything after `node` reads (or writes) base's storage where `region` lies."""
    for alias in _aliases(base):
        if not _overlap(_base_of(alias)[1] if alias is not base else None, region):
            continue
        for user in alias.users:
            if user is node or _is_view(user):
                continue
            if user.op == "output" or order[user] > order[node]:
                return True
    return False


def can_reinplace(node: fx.Node, mutates: tuple[int, ...], order: dict) -> bool:
    """Whether node's arguments at `mutates` are the graph's to overwrite at node (the module
    docstring's conditions), no other argument of node reading them, and node's outputs read
    only through getitem."""
    written = []
    for i in mutates:
        arg = node.args[i]
        if not isinstance(arg, fx.Node):
            return False
        base, region = _base_of(arg)
        if base is None or not _owned(base) or _read_after(base, region, node, order):
            return False
        written.append((i, base, region))
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and isinstance(fake_value(arg), torch.Tensor):
            base, region = _base_of(arg)
            if any(i != j and base is b and _overlap(region, r) for j, b, r in written):
                return False
    return all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users)


def _variants() -> dict:
    """graph op -> its in-place form, over every registered implementation."""
    return {resolved(impl.graph_op): impl.inplace for op in ir.REGISTRY.values()
            for impl in op.impls.values() if impl.inplace is not None}


class ReinplaceIrOps(KilnInductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        variants = _variants()
        for node in list(graph.nodes):
            variant = variants.get(node.target) if node.op == "call_function" else None
            if variant is None or node.kwargs:  # the lowering keeps IR calls' positional form
                continue
            args = [fake_value(a) if isinstance(a, fx.Node) else a for a in node.args]
            if any(isinstance(a, fx.Node) and v is None for a, v in zip(node.args, args)) \
                    or not variant.supported(*args):
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            if not can_reinplace(node, variant.mutates, order):
                continue
            with graph.inserting_before(node):
                call = graph.call_function(resolved(variant.op), tuple(node.args))
            call.meta["val"] = None
            for user in list(node.users):  # output i is now the argument it was written into
                user.replace_all_uses_with(node.args[variant.mutates[user.args[1]]])
                graph.erase_node(user)
            graph.erase_node(node)
            self.matched += 1
        graph.lint()
