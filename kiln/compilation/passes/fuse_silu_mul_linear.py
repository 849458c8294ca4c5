"""Post-grad pass: the IR op silu_and_mul feeding only the IR op linear (an MLP's down
projection) becomes one `kiln::silu_mul_linear` call (its CPU kernel in csrc/linear_op.cpp, the
activation by the native C kernel), saving a call between the two linears. Float32 only.
"""
import torch
from torch import fx

from kiln import ir
from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (
    all_float32,
    calls,
    linear_bias,
    linear_tail,
    only_user,
)
from kiln.compilation.passes.pass_manager import KilnInductorPass


def match(linear: fx.Node) -> fx.Node | None:
    """The silu_and_mul node when linear(silu_and_mul(x)) is what `linear` computes, with no
    other user of the activation and x, the weight and bias float32."""
    act = linear.args[0]
    if not (fx_match.is_call(act, ir.silu_and_mul.packet) and only_user(act, linear)):
        return None
    if not all_float32(act.args[0], linear.args[1], linear_bias(linear)):
        return None
    return act


class FuseSiluMulLinear(KilnInductorPass):
    helper_modules = (fx_match,)

    def __call__(self, graph: fx.Graph) -> None:
        for linear in calls(graph, ir.linear.packet):
            act = match(linear)
            if act is None:
                continue
            with graph.inserting_before(linear):
                fused = graph.call_function(
                    torch.ops.kiln.silu_mul_linear.default,
                    (act.args[0], linear.args[1], *linear_tail(linear)))
            fused.meta["val"] = linear.meta["val"]
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            graph.erase_node(act)
            self.matched += 1
        graph.lint()
