"""Post-grad pass: the IR op silu_and_mul feeding only a linear IR op (`linear`, `gguf_linear`: an
MLP's down projection) becomes one `kiln::silu_mul_linear` (`silu_mul_gguf_linear`) call (its
CPU kernel in csrc/linear_op.cpp, the activation by the native C kernel), saving a call between
the two. Float32 only.
"""
import torch
from torch import fx

from kiln import ir
from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (
    all_float32,
    call_args,
    linear_calls,
    linear_operands,
    only_user,
)
from kiln.compilation.passes.pass_manager import KilnInductorPass

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


class FuseSiluMulLinear(KilnInductorPass):
    """`linear_ops`: the names of the linear IR ops it fuses into (both by default)."""
    def __init__(self, linear_ops=tuple(FUSED)):
        self.linear_ops = tuple(linear_ops)

    def factors(self) -> dict:
        return {"linear_ops": self.linear_ops}

    def __call__(self, graph: fx.Graph) -> None:
        ops = {ir.REGISTRY[name].packet: FUSED[name] for name in self.linear_ops}
        for linear in linear_calls(graph, [ir.REGISTRY[n] for n in self.linear_ops]):
            act = match(linear)
            if act is None:
                continue
            with graph.inserting_before(linear):
                fused = graph.call_function(
                    getattr(torch.ops.kiln, ops[linear.target]).default,
                    (act.args[0], *call_args(linear)[1:]))
            fused.meta["val"] = linear.meta["val"]
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            graph.erase_node(act)
            self.matched += 1
        graph.lint()
