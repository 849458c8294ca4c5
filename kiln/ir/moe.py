"""The IR's mixture-of-experts op, `kiln::fused_moe`: softmax routing over the router's logits, each
token's top-k experts (SiLU-gated MLPs, stacked weights) run and summed by their routing weight.

The reference runs only the experts some token was routed to, on those tokens: its shapes depend
on the routing, so a compiled graph keeps the op as one opaque node (as all_reduce), never inlined.
"""
import torch
import torch.nn.functional as F

from kiln.ir.layer_ops import _silu_and_mul_ref
from kiln.ir.op import Implementation, define


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): softmax in
    float32, the k largest, divided by their sum when `renormalize` (HF's norm_topk_prob;
    Mixtral always). HF's routers compute exactly this."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """x [T, H]; router_logits [T, E]; w13 [E, 2I, H] (each expert's [gate | up] rows); w2
    [E, H, I] -> [T, H] in x's dtype: sum over each token's top-k experts e (route()) of
    weight_e * down_e(silu(gate_e x) * up_e x). Each expert's MLP runs in x's dtype as HF's
    does; the weighted sum is taken in float32 and rounded once (HF rounds each expert's
    weighted output, then sums: within a rounding step in bfloat16, equal in float32). Under
    tensor parallelism w13 / w2 hold this rank's slice of I and the result is its partial sum."""
    num_tokens = x.shape[0]
    weights, ids = route(router_logits, top_k, renormalize)
    flat_ids = ids.reshape(-1)  # [T*k], token t's slots at t*k ... t*k+k-1
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one sync per call
    tokens = order // top_k
    slot_weights = weights.reshape(-1)[order].unsqueeze(1)  # [T*k, 1] float32
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:  # no token chose it: not run
            continue
        rows = tokens[start:start + n]
        hidden = _silu_and_mul_ref(F.linear(x.index_select(0, rows), w13[expert]))  # [n, I]
        y = F.linear(hidden, w2[expert])  # [n, H]
        out.index_add_(0, rows, y.float() * slot_weights[start:start + n])
        start += n
    return out.to(x.dtype)


def _fused_moe_fake(x, router_logits, w13, w2, top_k, renormalize):
    return x.new_empty((x.shape[0], w2.shape[1]))


def _examples(dtype: torch.dtype, device: str):
    def t(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)
    return t(2, 64), t(2, 4), t(4, 64, 64), t(4, 64, 32), 2, True


fused_moe = define(
    "fused_moe", "(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, int top_k, "
    "bool renormalize) -> Tensor", _fused_moe_ref, _fused_moe_fake, _examples)
# In a graph the node stays (its shapes inside depend on the routing); its kernel runs the
# reference.
fused_moe.register(Implementation("torch", _fused_moe_ref, graph_op=fused_moe.packet))
