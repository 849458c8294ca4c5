"""Post-grad pass: the IR op silu_and_mul feeding only a linear IR op (`linear`, `gguf_linear`: an
MLP's down projection) becomes one `kiln::silu_mul_linear` (`silu_mul_gguf_linear`) call (its
CPU kernel in csrc/fused_linear_op.cpp, the activation by the native C kernel), saving a call
between the two. Float32 only.
"""
from torch import fx

from kiln import ir
from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (
    all_float32,
    call_args,
    linear_operands,
    only_user,
)
from kiln.compilation.passes.linear_fusion import LinearFusionPass

# linear IR op -> the fused op that ends in it
FUSED = {"linear": "silu_mul_linear", "gguf_linear": "silu_mul_gguf_linear"}


def match(linear: fx.Node) -> fx.Node | None:
    """The silu_and_mul node when linear(silu_and_mul(x)) is what `linear` computes, with no
    other user of the activation and x, the weight and bias float32."""
    act = linear.args[0]
    if not (fx_match.is_call(act, ir.silu_and_mul.packet) and only_user(act, linear)):
        return None
    if not all_float32(act.args[0], *linear_operands(linear)):
        return None
    return act


class FuseSiluMulLinear(LinearFusionPass):
    FUSED = FUSED

    def __call__(self, graph: fx.Graph) -> None:
        for linear, act, fused_op in self.fusable(graph, match):
            with graph.inserting_before(linear):
                fused = graph.call_function(fused_op, (act.args[0], *call_args(linear)[1:]))
            fused.meta["val"] = linear.meta["val"]
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            graph.erase_node(act)
            self.matched += 1
        graph.lint()
