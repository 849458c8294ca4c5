"""The IR's mixture-of-experts op, `kiln::fused_moe`: softmax routing over the router's logits, each
token's top-k experts (SiLU-gated MLPs, stacked weights) run and summed by their routing weight.

The reference runs only the experts some token was routed to, on those tokens: its shapes depend
on the routing, so a compiled graph keeps the op as one opaque node (as all_reduce), never inlined.
While a CUDA graph is recorded the op runs every expert on every token instead (_fused_moe_dense).
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


def _fused_moe_dense(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The reference's result with work that does not depend on the routing: every expert on
    every token, the tokens that did not choose it masked out of its sum. A CUDA graph replays
    what it recorded for any later routing, and the reference's host read of the expert counts
    cannot be recorded at all (E / top_k times the expert FLOPs, for graph-sized batches)."""
    weights, ids = route(router_logits, top_k, renormalize)
    num_experts = w13.shape[0]
    routed = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    routed.scatter_(1, ids, weights)  # [T, E]: each token's weight per expert, 0 if not chosen
    chosen = torch.zeros_like(routed, dtype=torch.bool).scatter_(1, ids, True)  # [T, E]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(num_experts):
        y = F.linear(_silu_and_mul_ref(F.linear(x, w13[expert])), w2[expert])  # [T, H]
        # where, not a product by 0: an expert's inf / NaN on a token that did not choose it
        # stays out of that token's sum, as in the reference
        out += torch.where(chosen[:, expert:expert + 1], y.float() * routed[:, expert:expert + 1],
                           0.0)
    return out.to(x.dtype)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fused_moe_torch(x, router_logits, w13, w2, top_k, renormalize):
    """The torch provider: the reference, or its routing-independent form while a CUDA graph
    (piecewise or FULL, mode 3's default on CUDA) is recorded."""
    run = _fused_moe_dense if _capturing() else _fused_moe_ref
    return run(x, router_logits, w13, w2, top_k, renormalize)


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
# reference (the dense form while a CUDA graph records it).
fused_moe.register(Implementation("torch", _fused_moe_torch, graph_op=fused_moe.packet))
