"""Post-grad pass: the IR op fused_add_rms_norm whose normed output feeds only a linear IR op
(`linear`, `gguf_linear`) becomes one `kiln::add_rms_norm_linear` (`add_rms_norm_gguf_linear`)
call (its CPU kernel in csrc/fused_linear_op.cpp).

Inductor or a native call would otherwise run the norm on its own between two linears: a call
that cost 3-5 us in a decode step, two a layer. The fused op returns the sum too, for the
residual's later users. Float32 only (the kernel's exact path; bfloat16 gains nothing).
"""
import operator

from torch import fx

from kiln import ir
from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (
    all_float32,
    call_args,
    getitem_of,
    linear_operands,
    only_user,
)
from kiln.compilation.passes.linear_fusion import LinearFusionPass

# linear IR op -> the fused op that ends in it
FUSED = {"linear": "add_rms_norm_linear", "gguf_linear": "add_rms_norm_gguf_linear"}


def match(linear: fx.Node) -> dict | None:
    """The fused_add_rms_norm node and its outputs when linear(norm(x + residual)) is what
    `linear` computes, the normed value has no other user and every operand is float32."""
    normed = linear.args[0]
    if not (fx_match.is_call(normed, operator.getitem) and only_user(normed, linear)):
        return None
    norm = normed.args[0]
    if not (fx_match.is_call(norm, ir.fused_add_rms_norm.packet) and getitem_of(normed, norm, 0)):
        return None
    x, residual, norm_weight, eps = norm.args
    if not all_float32(x, residual, norm_weight, *linear_operands(linear)):
        return None
    totals = [u for u in norm.users if getitem_of(u, norm, 1)]
    if len(totals) + 1 != len(norm.users):
        return None
    return {"norm": norm, "normed": normed, "totals": totals,
            "args": (x, residual, norm_weight, eps)}


class FuseAddRmsNormLinear(LinearFusionPass):
    FUSED = FUSED

    def __call__(self, graph: fx.Graph) -> None:
        for linear, found, fused_op in self.fusable(graph, match):
            norm = found["norm"]
            # At the norm's place: its operands are ready there, the linear's weights always.
            with graph.inserting_before(norm):
                fused = graph.call_function(fused_op, (*found["args"], *call_args(linear)[1:]))
                out = graph.call_function(operator.getitem, (fused, 0))
                total = graph.call_function(operator.getitem, (fused, 1))
            total_val = norm.meta["val"][1]
            fused.meta["val"] = (linear.meta["val"], total_val)
            out.meta["val"], total.meta["val"] = linear.meta["val"], total_val
            for old in found["totals"]:
                old.replace_all_uses_with(total)
                graph.erase_node(old)
            linear.replace_all_uses_with(out)
            graph.erase_node(linear)
            graph.erase_node(found["normed"])
            graph.erase_node(norm)
            self.matched += 1
        graph.lint()
