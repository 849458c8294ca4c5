"""Split a Dynamo FX graph at the splitting ops (attention) into pieces, keeping node order.

Consecutive splitting ops share a piece, getitem stays with its producer, and symbolic-size
nodes move to the piece that uses them, so no piece returns a bare SymInt.
"""
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from kiln.logger import init_logger

logger = init_logger(__name__)


@dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: torch.nn.Module  # an fx.GraphModule; on a warm start a code-only copy of one


def op_names(target) -> set[str]:
    """Names a call target answers to: "ns::op" and "ns::op.overload" for a torch op."""
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
        return {name, f"{name}.{target._overloadname}", str(target)}
    if isinstance(target, torch._ops.OpOverloadPacket):
        return {target._qualified_op_name, str(target)}
    return {getattr(target, "__qualname__", str(target))}


def is_splitting_node(node: fx.Node, splitting_ops: list[str]) -> bool:
    return node.op == "call_function" and bool(op_names(node.target) & set(splitting_ops))


def _is_size_node(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (torch.ops.aten.sym_size.int,
                                                      torch.ops.aten.sym_size):
        return True
    return node.op == "call_method" and node.target == "size" and (
        len(node.args) > 1 or "dim" in node.kwargs)


def assign_pieces(graph: fx.Graph, splitting_ops: list[str]) -> tuple[dict[fx.Node, int],
                                                                      list[int]]:
    """Piece id of every compute node, and the ids of the splitting pieces. Pure on the graph."""
    piece_of: dict[fx.Node, int] = {}
    splitting_ids: list[int] = []
    current, in_split = 0, False
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], fx.Node) and node.args[0] in piece_of):
            piece_of[node] = piece_of[node.args[0]]
            continue
        if is_splitting_node(node, splitting_ops):
            if not in_split:
                current += 1
                splitting_ids.append(current)
                in_split = True
            piece_of[node] = current
            continue
        if in_split:
            current += 1
            in_split = False
        piece_of[node] = current
    return piece_of, splitting_ids


def _localise_size_nodes(graph: fx.Graph, piece_of: dict[fx.Node, int]) -> None:
    """Give each piece its own copy of a size node it uses (a SymInt must not cross pieces)."""
    for node in list(graph.nodes):
        if node not in piece_of or not _is_size_node(node):
            continue
        by_piece: dict[int, list[fx.Node]] = {}
        for user in node.users:
            by_piece.setdefault(piece_of.get(user, piece_of[node]), []).append(user)
        for pid, users in by_piece.items():
            if pid == piece_of[node]:
                continue
            with graph.inserting_before(min(users, key=_position(graph))):
                copy = graph.node_copy(node)
            piece_of[copy] = pid
            for user in users:
                user.replace_input_with(node, copy)
        if not node.users:
            graph.erase_node(node)
            del piece_of[node]


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def _tuple_outputs(split_gm: fx.GraphModule) -> None:
    """Make every piece return a tuple, also a piece with one output, and the stitching graph
    index it: a compiled piece hands back a sequence whichever way it is called (DirectCall
    returns the generated code's list). torch 2.13's split_module does this with
    tuple_return=True; torch 2.11's has no such argument."""
    for node in list(split_gm.graph.nodes):
        if node.op != "call_module":
            continue
        piece = getattr(split_gm, node.target)
        output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        piece.recompile()
        with split_gm.graph.inserting_after(node):
            value = split_gm.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(value, delete_user_cb=lambda user, value=value: user is not value)
    split_gm.recompile()


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule,
                                                                      list[SplitItem]]:
    """Split `gm` (modified in place) into a stitching module whose children are the pieces."""
    piece_of, splitting_ids = assign_pieces(gm.graph, splitting_ops)
    if splitting_ops and not splitting_ids:
        logger.warning("no op of compilation_config.splitting_ops %s is in the traced graph: it "
                       "stays one piece (is the op name right?)", splitting_ops)
    _localise_size_nodes(gm.graph, piece_of)
    gm.recompile()
    split_gm = split_module(gm, None, lambda node: piece_of[node], keep_original_order=True)
    _tuple_outputs(split_gm)
    items = []
    names = {node.target for node in split_gm.graph.nodes if node.op == "call_module"}
    for node in split_gm.graph.nodes:
        if node.op != "call_module" or node.target not in names:
            continue
        graph_id = int(node.target.replace("submod_", ""))
        items.append(SplitItem(node.target, graph_id, graph_id in splitting_ids,
                               getattr(split_gm, node.target)))
        names.discard(node.target)
    return split_gm, items
