"""`LinearFusionPass`: the base of the passes that fold an IR op feeding a linear IR op into one
kiln op call (fuse_rms_norm_linear.py, fuse_silu_mul_linear.py): their options and matching loop.
"""
import torch
from torch import fx

from kiln import ir
from kiln.compilation.passes.fx_match import linear_calls
from kiln.compilation.passes.pass_manager import KilnInductorPass


class LinearFusionPass(KilnInductorPass):
    """`linear_ops`: the names of the linear IR ops it fuses into (all of FUSED's by default).
    A subclass sets FUSED: linear IR op -> the fused op that ends in it."""
    FUSED: dict[str, str] = {}

    def __init__(self, linear_ops=None):
        self.linear_ops = tuple(self.FUSED if linear_ops is None else linear_ops)

    def factors(self) -> dict:
        return {"linear_ops": self.linear_ops}

    def fusable(self, graph: fx.Graph, match):
        """(linear node, what match(linear) found, the fused op) for each call of the linear IR
        ops that `match` accepts (None: not fusable), matched one at a time as the caller
        rewrites the graph between them."""
        ops = {ir.REGISTRY[name].packet: self.FUSED[name] for name in self.linear_ops}
        for linear in linear_calls(graph, [ir.REGISTRY[n] for n in self.linear_ops]):
            found = match(linear)
            if found is None:
                continue
            yield linear, found, getattr(torch.ops.kiln, ops[linear.target]).default
