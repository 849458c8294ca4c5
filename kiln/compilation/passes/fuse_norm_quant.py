"""Post-grad pass `fuse_norm_quant` (vLLM's name): an RMSNorm IR op, with or without the residual
add, whose normed output feeds only a dynamic_int8_quant becomes one
`(fused_add_)rms_norm_dynamic_int8_quant` IR op: the normed activation is never written out.

A normed value with a second user is left alone (the fused op does not return it). Numerics:
the fused op's reference is the composition of the two, and the native kernel runs the native
RMSNorm kernel itself into a cache-resident scratch (tests/quantization/test_int8_ops.py).
"""
import operator

from torch import fx

from kiln import ir
from kiln.compilation.passes.fx_match import calls, getitem_of, is_call, only_user
from kiln.compilation.passes.pass_manager import KilnInductorPass
from kiln.ir import quant


def _norm_of(value: fx.Node) -> tuple[fx.Node, bool] | None:
    """(norm node, with residual add) when `value` is an RMSNorm IR op's normed output."""
    if is_call(value, ir.rms_norm.packet):
        return value, False
    if is_call(value, operator.getitem) and is_call(value.args[0], ir.fused_add_rms_norm.packet) \
            and getitem_of(value, value.args[0], 0):
        return value.args[0], True
    return None


def replace_quant_outputs(graph: fx.Graph, q: fx.Node, fused: fx.Node) -> None:
    """The quant node's (q, scale) users now read the fused node's first two outputs."""
    for user in list(q.users):
        index = user.args[1]
        with graph.inserting_after(fused):
            new = graph.call_function(operator.getitem, (fused, index))
        new.meta["val"] = user.meta.get("val")
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(q)


class FuseNormQuant(KilnInductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        for q in calls(graph, quant.dynamic_int8_quant.packet):
            normed = q.args[0]
            found = _norm_of(normed)
            if found is None or not only_user(normed, q):
                continue
            norm, with_add = found
            if not all(getitem_of(u, q, 0) or getitem_of(u, q, 1) for u in q.users):
                continue
            op = (quant.fused_add_rms_norm_dynamic_int8_quant if with_add
                  else quant.rms_norm_dynamic_int8_quant)
            with graph.inserting_before(norm):
                fused = graph.call_function(op.packet, tuple(norm.args))
            q_val = q.meta["val"]
            if with_add:
                total_val = norm.meta["val"][1]
                fused.meta["val"] = (*q_val, total_val)
                for user in list(norm.users):  # the sum's users: fused[2]
                    if getitem_of(user, norm, 1):
                        with graph.inserting_after(fused):
                            total = graph.call_function(operator.getitem, (fused, 2))
                        total.meta["val"] = total_val
                        user.replace_all_uses_with(total)
                        graph.erase_node(user)
            else:
                fused.meta["val"] = q_val
            replace_quant_outputs(graph, q, fused)
            graph.erase_node(normed)
            if with_add:
                graph.erase_node(norm)
            self.matched += 1
        graph.lint()
