"""Post-grad pass `fuse_mm_act_quant`: an int8 GEMM over packed weights (`int8_scaled_mm_panels`)
whose output feeds only a `silu_and_mul_dynamic_int8_quant` (what `fuse_act_quant` made of an
MLP's activation and the down projection's quantization) becomes one
`int8_scaled_mm_panels_silu_quant` IR op, whose CPU kernel keeps the [tokens, 2 x intermediate]
gate/up projection in each thread's cache instead of writing it to memory and reading it back.

Runs after `fuse_act_quant`. Numerics: the fused reference is the composition of the two, and
the native kernel calls the unfused kernels' own functions on blocks of rows, so its q and
scales equal the unfused native pair's bit for bit (tests/quantization/test_int8_panels.py).
"""
from torch import fx

from kiln.compilation.passes.fx_match import call_args, calls, is_call, only_user
from kiln.compilation.passes.pass_manager import KilnInductorPass
from kiln.ir import int8_panels, quant


class FuseMmActQuant(KilnInductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        for act_quant in calls(graph, quant.silu_and_mul_dynamic_int8_quant.packet):
            mm = act_quant.args[0]
            if not (is_call(mm, int8_panels.int8_scaled_mm_panels.packet)
                    and only_user(mm, act_quant)):
                continue
            with graph.inserting_before(mm):
                fused = graph.call_function(int8_panels.int8_scaled_mm_panels_silu_quant.packet,
                                            call_args(mm))
            fused.meta["val"] = act_quant.meta["val"]
            act_quant.replace_all_uses_with(fused)  # both return (q, scale)
            graph.erase_node(act_quant)
            graph.erase_node(mm)
            self.matched += 1
        graph.lint()
