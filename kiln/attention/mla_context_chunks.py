"""Which slices of the prefill requests' cached contexts MLA's expanded form expands together
(vLLM's chunked-context workspace): pure planning, the workspace's default size, cache rows.

Each chunk's latent rows go through kv_b_proj at once, so a chunk's token count bounds the
per-head K / V held at a time; the attention over the chunks is merged by log-sum-exp
(kiln/attention/lse_merge.py) in kiln/attention/mla_prefill.py.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# vLLM caps its workspace at 64k tokens (min(max(8 * max_model_len, 4 * max_num_seqs *
# block_size), 64k)); upstream has no setting for it. Kiln bounds the expanded bytes instead
# (heads and dtype vary by model and rank) and keeps vLLM's cap as the ceiling.
MAX_WORKSPACE_TOKENS = 64 * 1024
# Bytes of one chunk's expanded K and V (V zero-padded to K's width): DeepSeek-V3 in bfloat16 at
# 128 heads gets 2730 tokens a chunk, V2-Lite (16 heads) 21845. With the transient kv_b_proj
# output, gathered rows and unpadded V beside them, the peak is about 3x this (measured: a 32k
# context at 16 heads in float32 peaked 724 MiB above its start, 1364 MiB unchunked).
WORKSPACE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ContextSlice:
    request: int  # index into the planned context lengths
    start: int  # first context token of the slice
    length: int


def default_workspace_tokens(num_heads: int, qk_dim: int, itemsize: int) -> int:
    """Context tokens a chunk expands: WORKSPACE_BYTES of K and V per head (each qk_dim wide,
    `itemsize` bytes a value), at most MAX_WORKSPACE_TOKENS, at least 1."""
    per_token = num_heads * 2 * qk_dim * itemsize
    return max(1, min(MAX_WORKSPACE_TOKENS, WORKSPACE_BYTES // per_token))


def plan_context_chunks(context_lens: Sequence[int],
                        workspace_tokens: int) -> list[list[ContextSlice]]:
    """Chunks of at most workspace_tokens context tokens, each a slice per request that has
    context left, in order; every request's context covered once, front to back.

    vLLM gives every request an equal share each chunk; here the share a short context leaves
    unused goes to the longer ones (shortest first, each taking at most an equal share of what
    is left), so chunks stay full and fewer. With more requests than tokens, the first
    workspace_tokens requests with context left take a token each."""
    if workspace_tokens < 1:
        raise ValueError(f"workspace_tokens must be >= 1, got {workspace_tokens}")
    done = [0] * len(context_lens)
    chunks = []
    while True:
        active = [i for i, n in enumerate(context_lens) if done[i] < n][:workspace_tokens]
        if not active:
            return chunks
        budget, take = workspace_tokens, {}
        for rank, i in enumerate(sorted(active, key=lambda i: context_lens[i] - done[i])):
            take[i] = min(context_lens[i] - done[i], budget // (len(active) - rank))
            budget -= take[i]
        chunks.append([ContextSlice(i, done[i], take[i]) for i in active])
        for i in active:
            done[i] += take[i]


def chunk_rows(chunk: list[ContextSlice], requests: Sequence[int], block_table: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Flat cache rows [chunk tokens] (block * block_size + offset) of a chunk's slices, in
    order; slice.request indexes `requests`, the batch rows of block_table [R, max_blocks]."""
    parts = []
    for s in chunk:
        pos = torch.arange(s.start, s.start + s.length, device=block_table.device)
        blocks = block_table[requests[s.request]].index_select(0, pos // block_size).long()
        parts.append(blocks * block_size + pos % block_size)
    return torch.cat(parts)
