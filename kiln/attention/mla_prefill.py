"""MLA's compute-friendly form for prefill tokens (vLLM's MLA prefill): a request's latent rows,
the cached context's and this step's, expanded per head through kv_b_proj into K's nope part and
V, then multi-head causal attention with the rope part of K shared by every head.

Per head that is qk_nope + rope dims of scores and v_head_dim of output, where the absorbed form
(kiln/attention/mla_backend.py) spends kv_lora_rank + rope and kv_lora_rank: about 3x fewer
FLOPs on long prompts, for one kv_b_proj GEMM over the keys. A cached context is expanded a
chunk at a time (mla_context_chunks.py), each chunk's attention merged by log-sum-exp.
"""
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.attention.lse_merge import attention_with_lse, merge_attn_states
from kiln.attention.masking import key_mask
from kiln.attention.mla_context_chunks import ContextSlice


@dataclass(frozen=True)
class MLADims:
    num_heads: int  # this rank's
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    latent: int  # kv_lora_rank
    v_dim: int  # v_head_dim

    @property
    def qk_dim(self) -> int:
        return self.nope + self.rope


def expand_latent(rows: torch.Tensor, w_kv_b: torch.Tensor,
                  dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows [S, latent + rope] through kv_b_proj's weight [nh * (nope + v), latent] ->
    k [nh, S, nope + rope] (k_pe repeated per head), v [nh, S, max(v_dim, nope + rope)].

    V is zero-padded past v_dim to K's width, sliced off the output: CPU torch's flash kernel
    wants V as wide as K (else the math path, several times slower; vLLM pads V the same way)."""
    num_keys, nh = rows.shape[0], dims.num_heads
    latent, k_pe = rows.split([dims.latent, dims.rope], dim=-1)
    kv = F.linear(latent, w_kv_b).view(num_keys, nh, dims.nope + dims.v_dim)
    k_nope, v = kv.split([dims.nope, dims.v_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(num_keys, nh, dims.rope)), dim=-1)
    pad = dims.qk_dim - dims.v_dim
    if pad > 0:
        v = F.pad(v, (0, pad))
    return k.transpose(0, 1), v.transpose(0, 1)


def expanded_attention(q: torch.Tensor, rows: torch.Tensor, w_kv_b: torch.Tensor,
                       dims: MLADims, scale: float) -> torch.Tensor:
    """One request's queries q [L, nh, nope + rope] (roped), the last L of its keys' rows
    [S, latent + rope] (S - L context rows first) -> out [L, nh, v_dim], causal."""
    num_queries, num_keys = q.shape[0], rows.shape[0]
    k, v = expand_latent(rows.to(q.dtype), w_kv_b, dims)
    qh = q.transpose(0, 1)  # [nh, L, qk]
    if num_keys == num_queries:  # a fresh prompt: plain causal
        mask = {"is_causal": True}
    else:
        key_pos = torch.arange(num_keys, device=q.device)
        mask = {"attn_mask": key_mask(key_pos[num_keys - num_queries:], key_pos, None)}
    o = F.scaled_dot_product_attention(qh[None], k[None], v[None], scale=scale, **mask)[0]
    return o[..., :dims.v_dim].transpose(0, 1)  # [L, nh, v_dim]


def chunked_context_attention(queries: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
                              chunks: Iterable[tuple[list[ContextSlice], torch.Tensor]],
                              w_kv_b: torch.Tensor, dims: MLADims,
                              scale: float) -> list[torch.Tensor]:
    """Requests over cached context, the context expanded a chunk at a time: queries[j]
    [L, nh, nope + rope] (roped) with this step's rows[j] [L, latent + rope]; `chunks` yields
    (list of ContextSlice, slice.request indexing queries; that chunk's cache rows
    [chunk tokens, latent + rope] in slice order) -> out [L, nh, v_dim] per request.

    Each request's causal attention over its own rows, then each chunk's slices expanded in
    one kv_b_proj GEMM and attended unmasked (the context precedes every query), the partial
    results merged by log-sum-exp: vLLM's _compute_prefill_context and merge_attn_states."""
    def attend(q, k, v, causal):  # V's padding off before merging: [nh, L, v_dim], lse
        o, lse = attention_with_lse(q.transpose(0, 1), k, v, scale, causal)
        # merged in float32, rounded once at the end: a bfloat16 running state rounded at
        # every merge drifted with the chunk count (a 1500-token context a token a chunk:
        # 40x the unchunked error; logprobs 0.24 off where unchunked bfloat16 is 0.03)
        return o[..., :dims.v_dim].float(), lse

    states = []
    for q, own in zip(queries, rows):
        states.append(attend(q, *expand_latent(own.to(q.dtype), w_kv_b, dims), causal=True))
    for chunk, latent in chunks:
        k, v = expand_latent(latent.to(queries[0].dtype), w_kv_b, dims)  # [nh, chunk, qk]
        offset = 0
        for s in chunk:
            end = offset + s.length
            part = attend(queries[s.request], k[:, offset:end], v[:, offset:end], causal=False)
            states[s.request] = merge_attn_states(*states[s.request], *part)
            offset = end
    return [o.transpose(0, 1).to(q.dtype) for (o, _), q in zip(states, queries)]  # [L, nh, v]
