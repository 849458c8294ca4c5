"""Post-grad pass: SiLU-and-mul feeding `kiln::linear` (an MLP's down projection) becomes one
`kiln::silu_mul_linear` call (its CPU kernel in csrc/linear_op.cpp, the activation by the eager
forward's C kernel), saving Inductor's kernel between the two linears. Float32 graphs only.
"""
import torch
from torch import fx

from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (all_float32, fake_value, is_call, linear_bias,
                                              linear_nodes, only_user)
from kiln.compilation.passes.pass_manager import KilnInductorPass

aten = torch.ops.aten


def _last_dim_slice(node, x, start: int) -> int | None:
    """The slice's end when `node` is x[..., start:end] along x's last dim, else None."""
    if not (is_call(node, aten.slice.Tensor) and node.args[0] is x and len(node.args) >= 4):
        return None
    rank = fake_value(x).dim()
    dim, begin, end = node.args[1:4]
    if dim not in (-1, rank - 1) or begin != start or len(node.args) > 4 and node.args[4] != 1:
        return None
    return end


def match(linear: fx.Node) -> dict | None:
    """x and the nodes to drop when linear(silu(x[..., :d]) * x[..., d:]) with x [..., 2d]
    float32 (silu as Inductor's decomposition has it: g / (1 + exp(-g))), else None."""
    product = linear.args[0]
    if not (is_call(product, aten.mul.Tensor) and only_user(product, linear)):
        return None
    for silu, up in (product.args[:2], product.args[1::-1]):
        if not (is_call(silu, aten.div.Tensor) and only_user(silu, product)):
            continue
        gate, denominator = silu.args[:2]
        if not (is_call(denominator, aten.add.Tensor) and denominator.args[1] == 1
                and only_user(denominator, silu)):
            continue
        exp = denominator.args[0]
        if not (is_call(exp, aten.exp.default) and only_user(exp, denominator)):
            continue
        neg = exp.args[0]
        if not (is_call(neg, aten.neg.default) and neg.args[0] is gate and only_user(neg, exp)):
            continue
        x = gate.args[0] if is_call(gate, aten.slice.Tensor) else None
        if x is None or not all_float32(x, linear.args[1]) or set(gate.users) != {neg, silu}:
            return None
        width = fake_value(x).shape[-1]
        d = _last_dim_slice(gate, x, 0)
        if not isinstance(width, int) or d != width // 2 or width % 2:
            return None
        end = _last_dim_slice(up, x, d)
        if end is None or end < width or not only_user(up, product):
            return None
        return {"x": x, "dead": [product, silu, denominator, exp, neg, gate, up]}
    return None


class FuseSiluMulLinear(KilnInductorPass):
    helper_modules = (fx_match,)

    def __call__(self, graph: fx.Graph) -> None:
        for linear in linear_nodes(graph):
            found = match(linear)
            if found is None:
                continue
            with graph.inserting_before(linear):
                fused = graph.call_function(torch.ops.kiln.silu_mul_linear.default,
                                            (found["x"], linear.args[1], linear_bias(linear)))
            fused.meta["val"] = linear.meta["val"]
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            for node in found["dead"]:
                if not node.users:
                    graph.erase_node(node)
        graph.lint()
