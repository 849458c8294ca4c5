"""Attention that also returns each query's log-sum-exp of scores, and the merge of two partial
results over disjoint key sets into the result over their union (vLLM's merge_attn_states).

Lets a caller attend to keys a piece at a time (MLA's chunked context: mla_context_chunks.py)
and get, within float rounding, what one attention over all of them gives.
"""
import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [nh, L, d], k [nh, S, d], v [nh, S, d] -> (out [nh, L, d] in q's dtype, lse [nh, L]
    float32). `causal` masks the square case (L == S: a query sees the keys up to its own)."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention_with_lse wants as many queries as keys, got "
                         f"{q.shape[1]} queries and {k.shape[1]} keys")
    if q.device.type == "cpu":
        # CPU torch's flash kernel returns the lse SDPA keeps to itself (4-D, one head size)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale)
        return o[0], lse[0].float()
    return math_attention_with_lse(q, k, v, scale, causal)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse off CPU: the scores in float32, [nh, L, S] (bounded by the caller's
    key chunk)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores.masked_fill_(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return o.to(q.dtype), lse


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalized partials over disjoint keys, out [..., L, d] with lse [..., L]
    -> (out over both keys in out_a's dtype, its lse float32). A side whose lse is -inf (no
    keys) gets weight 0: the other passes through."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # -inf - -inf is nan: where both sides are empty the weights are 0 and the output 0
    finite = torch.isfinite(lse)
    w_a = torch.where(finite, torch.exp(lse_a - lse), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - lse), 0.0)[..., None]
    out = torch.addcmul(out_a.float() * w_a, out_b.float(), w_b)
    return out.to(out_a.dtype), lse
