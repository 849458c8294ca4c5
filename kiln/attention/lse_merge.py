"""Attention that also returns each query's log-sum-exp of scores, and the merge of two partial
results over disjoint key sets into the result over their union (vLLM's merge_attn_states).

Lets a caller attend to keys a piece at a time (MLA's chunked context: mla_context_chunks.py)
and get, within float rounding, what one attention over all of them gives.
"""
import torch

# Bytes of float32 scores math_attention_with_lse holds for one block of queries.
SCORE_BYTES = 256 * 2**20


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [nh, L, d], k [nh, S, d], v [nh, S, d] -> (out [nh, L, d] in q's dtype, lse [nh, L]
    float32). `causal` masks the square case (L == S: a query sees the keys up to its own)."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention_with_lse wants as many queries as keys, got "
                         f"{q.shape[1]} queries and {k.shape[1]} keys")
    if k.shape[1] == 0:  # no keys: nothing attended (CPU torch's kernel dies of SIGFPE here)
        return (q.new_zeros(*q.shape[:2], v.shape[2]),
                torch.full(q.shape[:2], float("-inf"), device=q.device))
    if q.device.type == "cpu":
        # CPU torch's flash kernel returns the lse SDPA keeps to itself (4-D, one head size)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale)
        return o[0], lse[0].float()
    return math_attention_with_lse(q, k, v, scale, causal)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse off CPU: the scores in float32, a block of queries at a time, each
    block's [nh, rows, S] within SCORE_BYTES (score_rows). The key chunk bounds S for the
    context, but a request's own rows are L x L: 16 heads at 8192 tokens were 4 GiB of scores
    at once, twice that with their exponentials."""
    num_queries = q.shape[1]
    rows = score_rows(q.shape[0], k.shape[1])
    if rows >= num_queries:
        return _attend_rows(q, k, v, scale, causal, 0)
    parts = [_attend_rows(q[:, i:i + rows], k, v, scale, causal, i)
             for i in range(0, num_queries, rows)]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=1)


def score_rows(num_heads: int, num_keys: int) -> int:
    """Queries a block of math_attention_with_lse takes: SCORE_BYTES of float32 scores over
    num_keys keys per head, at least 1."""
    return max(1, SCORE_BYTES // (4 * num_heads * max(1, num_keys)))


def _attend_rows(q, k, v, scale, causal, first) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries first .. first + q.shape[1] - 1 of the square causal case (or of unmasked
    attention) over every key: (out in q's dtype, lse float32)."""
    if causal:  # these queries see the keys up to their own
        k, v = k[:, :first + q.shape[1]], v[:, :first + q.shape[1]]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(first)
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
