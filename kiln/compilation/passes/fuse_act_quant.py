"""Post-grad pass `fuse_act_quant` (vLLM's name): a silu_and_mul IR op whose output feeds only a
dynamic_int8_quant becomes one `silu_and_mul_dynamic_int8_quant` IR op.

Numerics: bit-identical under either provider. The fused torch reference is the composition,
and the native fused kernel equals the unfused native pair bit for bit (its SiLU takes every value
through the same path whatever the call's shape); tests/quantization/test_int8_ops.py checks it.
"""
from torch import fx

from kiln import ir
from kiln.compilation.passes.fuse_norm_quant import replace_quant_outputs
from kiln.compilation.passes.fx_match import calls, getitem_of, is_call, only_user
from kiln.compilation.passes.pass_manager import KilnInductorPass
from kiln.ir import quant


class FuseActQuant(KilnInductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        for q in calls(graph, quant.dynamic_int8_quant.packet):
            act = q.args[0]
            if not (is_call(act, ir.silu_and_mul.packet) and only_user(act, q)):
                continue
            if not all(getitem_of(u, q, 0) or getitem_of(u, q, 1) for u in q.users):
                continue
            with graph.inserting_before(act):
                fused = graph.call_function(quant.silu_and_mul_dynamic_int8_quant.packet,
                                            tuple(act.args))
            fused.meta["val"] = q.meta["val"]
            replace_quant_outputs(graph, q, fused)
            graph.erase_node(act)
            self.matched += 1
        graph.lint()
