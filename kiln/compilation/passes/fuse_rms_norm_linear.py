"""Post-grad pass: a residual add and the RMSNorm after it, feeding `kiln::linear`, become one
`kiln::add_rms_norm_linear` call (its CPU kernel in csrc/linear_op.cpp).

Inductor would otherwise give them a kernel of their own between two linears: a call from its
Python wrapper that cost 3-5 us in a decode step (1.2 us measured alone), two a layer. The op
returns the sum too, for the residual's later users. Float32 only: the bfloat16 form casts.
"""
import operator

import torch
from torch import fx

from kiln.compilation.passes import fx_match
from kiln.compilation.passes.fx_match import (all_float32, fake_value, is_call, linear_bias,
                                              linear_nodes, only_user)
from kiln.compilation.passes.pass_manager import KilnInductorPass

aten = torch.ops.aten


def match(linear: fx.Node) -> dict | None:
    """The pieces of add -> RMSNorm -> `linear` when that is what feeds it, else None:
    linear(w * (x * rsqrt(mean(x ** 2, -1, keepdim) + eps))), x = a + b, all float32."""
    normed = linear.args[0]
    if not (is_call(normed, aten.mul.Tensor) and only_user(normed, linear)):
        return None
    for scaled, norm_weight in (normed.args[:2], normed.args[1::-1]):
        if not (is_call(scaled, aten.mul.Tensor) and only_user(scaled, normed)):
            continue
        for x, rsqrt in (scaled.args[:2], scaled.args[1::-1]):
            if not (is_call(rsqrt, aten.rsqrt.default) and only_user(rsqrt, scaled)):
                continue
            plus_eps = rsqrt.args[0]
            if not (is_call(plus_eps, aten.add.Tensor) and only_user(plus_eps, rsqrt)
                    and isinstance(plus_eps.args[1], float)):
                continue
            mean, eps = plus_eps.args[0], plus_eps.args[1]
            if not (is_call(mean, aten.mean.dim) and only_user(mean, plus_eps)
                    and list(mean.args[1]) in ([-1], [len(fake_value(x).shape) - 1])
                    and (mean.args[2:3] == (True,) or mean.kwargs.get("keepdim"))):
                continue
            square = mean.args[0]
            if not (is_call(square, aten.pow.Tensor_Scalar) and square.args == (x, 2)
                    and only_user(square, mean)):
                continue
            if not (is_call(x, aten.add.Tensor) and len(x.args) == 2 and not x.kwargs):
                return None
            a, b = x.args
            if not all_float32(a, b, x, norm_weight, linear.args[1]):
                return None
            shape = fake_value(x).shape
            if fake_value(a).shape != shape or fake_value(b).shape != shape:
                return None
            if fake_value(norm_weight).dim() != 1:
                return None
            return {"x": x, "a": a, "b": b, "norm_weight": norm_weight, "eps": eps,
                    "dead": [normed, scaled, rsqrt, plus_eps, mean, square]}
    return None


class FuseAddRmsNormLinear(KilnInductorPass):
    helper_modules = (fx_match,)

    def __call__(self, graph: fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        for linear in linear_nodes(graph):
            found = match(linear)
            if found is None:
                continue
            x = found["x"]
            # The sum's other users must come after the linear, where the fused op puts it.
            others = [u for u in x.users if u not in found["dead"]]
            if any(order[u] < order[linear] for u in others):
                continue
            weight, bias = linear.args[1], linear_bias(linear)
            with graph.inserting_before(linear):
                fused = graph.call_function(
                    torch.ops.kiln.add_rms_norm_linear.default,
                    (found["a"], found["b"], found["norm_weight"], found["eps"], weight, bias))
                out = graph.call_function(operator.getitem, (fused, 0))
                total = graph.call_function(operator.getitem, (fused, 1))
            fused.meta["val"] = (linear.meta["val"], x.meta["val"])
            out.meta["val"], total.meta["val"] = linear.meta["val"], x.meta["val"]
            for user in others:
                user.replace_input_with(x, total)
            linear.replace_all_uses_with(out)
            graph.erase_node(linear)
            for node in found["dead"] + [x]:
                if not node.users:
                    graph.erase_node(node)
        graph.lint()
