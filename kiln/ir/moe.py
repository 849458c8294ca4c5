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


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_weights: torch.Tensor | None = None,
          topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): softmax in
    float32, the k largest, divided by their sum when `renormalize` (HF's norm_topk_prob;
    Mixtral always). HF's routers compute exactly this. A model whose router follows another
    rule (DeepSeek's grouped / sigmoid top-k: kiln/model/layers/deepseek_routing.py) passes
    its routing as topk_weights [T, k] and topk_ids [T, k], used as given."""
    if topk_ids is not None:
        return topk_weights.float(), topk_ids.long()
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def routed_sum(x: torch.Tensor, router_logits: torch.Tensor, num_experts: int, out_size: int,
               expert_mlp, top_k: int, renormalize: bool, topk_weights=None,
               topk_ids=None) -> torch.Tensor:
    """sum over each token's top-k experts e (route()) of weight_e * expert_mlp(e, x_e) [n, out],
    x_e the rows of x routed to e; only experts some token chose run. The weighted sum is taken
    in float32 and rounded once to x's dtype (what fused_moe and fused_moe_int8 share).
    topk_weights / topk_ids: a routing given (route())."""
    num_tokens = x.shape[0]
    weights, ids = route(router_logits, top_k, renormalize, topk_weights, topk_ids)
    flat_ids = ids.reshape(-1)  # [T*k], token t's slots at t*k ... t*k+k-1
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # one sync per call
    tokens = order // top_k
    slot_weights = weights.reshape(-1)[order].unsqueeze(1)  # [T*k, 1] float32
    out = torch.zeros(num_tokens, out_size, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:  # no token chose it: not run
            continue
        rows = tokens[start:start + n]
        y = expert_mlp(expert, x.index_select(0, rows))  # [n, out]
        out.index_add_(0, rows, y.float() * slot_weights[start:start + n])
        start += n
    return out.to(x.dtype)


def dense_sum(x: torch.Tensor, router_logits: torch.Tensor, num_experts: int, out_size: int,
              expert_mlp, top_k: int, renormalize: bool, topk_weights=None,
              topk_ids=None) -> torch.Tensor:
    """routed_sum's result with work that does not depend on the routing: every expert on
    every token, the tokens that did not choose it masked out of its sum. A CUDA graph replays
    what it recorded for any later routing, and routed_sum's host read of the expert counts
    cannot be recorded at all (E / top_k times the expert FLOPs, for graph-sized batches).
    Equal to routed_sum where expert_mlp treats each row alone (every expert MLP here does)."""
    weights, ids = route(router_logits, top_k, renormalize, topk_weights, topk_ids)
    routed = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    routed.scatter_(1, ids, weights)  # [T, E]: each token's weight per expert, 0 if not chosen
    chosen = torch.zeros_like(routed, dtype=torch.bool).scatter_(1, ids, True)  # [T, E]
    out = torch.zeros(x.shape[0], out_size, dtype=torch.float32, device=x.device)
    for expert in range(num_experts):
        y = expert_mlp(expert, x)  # [T, out]
        # where, not a product by 0: an expert's inf / NaN on a token that did not choose it
        # stays out of that token's sum, as in the reference
        out += torch.where(chosen[:, expert:expert + 1], y.float() * routed[:, expert:expert + 1],
                           0.0)
    return out.to(x.dtype)


def _float_expert(w13: torch.Tensor, w2: torch.Tensor):
    """Expert e's SiLU-gated MLP in x's dtype, as HF's runs it."""
    def mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_silu_and_mul_ref(F.linear(x, w13[expert])), w2[expert])
    return mlp


def _fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, top_k: int, renormalize: bool,
                   topk_weights: torch.Tensor | None = None,
                   topk_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; router_logits [T, E]; w13 [E, 2I, H] (each expert's [gate | up] rows); w2
    [E, H, I] -> [T, H] in x's dtype: sum over each token's top-k experts e (route()) of
    weight_e * down_e(silu(gate_e x) * up_e x). Each expert's MLP runs in x's dtype as HF's
    does; the weighted sum is taken in float32 and rounded once (HF rounds each expert's
    weighted output, then sums: within a rounding step in bfloat16, equal in float32). Under
    tensor parallelism w13 / w2 hold this rank's slice of I and the result is its partial sum.
    topk_weights / topk_ids [T, k]: a routing the model computed itself, used instead of
    route()'s softmax top-k of router_logits (DeepSeek's)."""
    return routed_sum(x, router_logits, w13.shape[0], w2.shape[1], _float_expert(w13, w2), top_k,
                      renormalize, topk_weights, topk_ids)


def _fused_moe_dense(x, router_logits, w13, w2, top_k, renormalize, topk_weights=None, topk_ids=None):
    """The reference's result, every expert run on every token (dense_sum)."""
    return dense_sum(x, router_logits, w13.shape[0], w2.shape[1], _float_expert(w13, w2), top_k,
                     renormalize, topk_weights, topk_ids)


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fused_moe_torch(x, router_logits, w13, w2, top_k, renormalize, topk_weights=None, topk_ids=None):
    """The torch provider: the reference, or its routing-independent form while a CUDA graph
    (piecewise or FULL, mode 3's default on CUDA) is recorded."""
    run = _fused_moe_dense if capturing() else _fused_moe_ref
    return run(x, router_logits, w13, w2, top_k, renormalize, topk_weights, topk_ids)


def _fused_moe_fake(x, router_logits, w13, w2, top_k, renormalize, topk_weights=None, topk_ids=None):
    return x.new_empty((x.shape[0], w2.shape[1]))


def _examples(dtype: torch.dtype, device: str):
    def t(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)
    return t(2, 64), t(2, 4), t(4, 64, 64), t(4, 64, 32), 2, True


fused_moe = define(
    "fused_moe", "(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, int top_k, "
    "bool renormalize, Tensor? topk_weights=None, Tensor? topk_ids=None) "
    "-> Tensor", _fused_moe_ref, _fused_moe_fake, _examples)
# In a graph the node stays (its shapes inside depend on the routing); its kernel runs the
# reference (the dense form while a CUDA graph records it).
fused_moe.register(Implementation("torch", _fused_moe_torch, graph_op=fused_moe.packet))
