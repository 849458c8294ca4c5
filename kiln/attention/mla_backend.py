"""Attention over a latent KV cache (DeepSeek's MLA, vLLM's layout): one cache row per token, the
normed latent c_kv (kv_lora_rank) then the roped k_pe, and no separate V.

As vLLM's MLA backends, a step's requests split by query length: prefill requests take the
expanded form (kiln/attention/mla_prefill.py; a cached context a bounded chunk at a time),
decode requests the weight-absorbed one (q_nope through kv_b_proj's W_UK into the latent, MQA
of one KV head over the cache rows, the latent output through W_UV), each written back at its
tokens' rows. The torch backend's code on every platform: the C kernels (K and V of one head
size) do not serve it.
"""
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate

import torch

from kiln.attention.backend import AttentionImpl
from kiln.attention.metadata import AttentionMetadata
from kiln.attention.mla_context_chunks import (
    chunk_rows,
    default_workspace_tokens,
    plan_context_chunks,
)
from kiln.attention.mla_prefill import MLADims, chunked_context_attention, expanded_attention
from kiln.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    _gather_context,
    _valid_slots,
)
from kiln.errors import ConfigError


def latent_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, int, int, int, int]:
    """[1 (K only), num_blocks, block_size, 1, kv_lora_rank + rope]: the K/V layout's dims with
    no V, so the block tables, slots and sizing read it alike."""
    if num_kv_heads != 1:
        raise ConfigError(f"a latent KV cache has one head, got num_kv_heads={num_kv_heads}")
    return (1, num_blocks, block_size, 1, head_size)


def split_decodes_and_prefills(query_lens: list[int],
                               decode_threshold: int = 1) -> tuple[list[int], list[int]]:
    """(decode requests, prefill requests) by index: a query of at most decode_threshold tokens
    decodes (vLLM's rule; the threshold is 1 + num_speculative_tokens when speculating, so a
    verify step stays absorbed); requests with no tokens this step are in neither. Any order:
    Kiln's runner does not put decodes first."""
    if decode_threshold < 1:
        raise ValueError(f"decode_threshold must be >= 1, got {decode_threshold}")
    decodes = [i for i, n in enumerate(query_lens) if 0 < n <= decode_threshold]
    prefills = [i for i, n in enumerate(query_lens) if n > decode_threshold]
    return decodes, prefills


def _sub_metadata(md: AttentionMetadata, reqs: list[int]) -> tuple[AttentionMetadata,
                                                                   torch.Tensor]:
    """The metadata of `reqs` alone, their tokens gathered in order, and those tokens' rows [Td]
    in the step's batch."""
    starts = md.query_start_loc_cpu.tolist()
    lens = [starts[i + 1] - starts[i] for i in reqs]
    device = md.seq_lens.device
    tokens = torch.tensor([t for i in reqs for t in range(starts[i], starts[i + 1])],
                          device=device)
    index = torch.tensor(reqs, device=device)
    query_start_cpu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    seq_lens_cpu = md.seq_lens_cpu[reqs]
    sub = replace(md, num_actual_tokens=len(tokens), num_reqs=len(reqs), max_query_len=max(lens),
                  max_seq_len=int(seq_lens_cpu.max()), query_start_loc=query_start_cpu.to(device),
                  seq_lens=md.seq_lens.index_select(0, index),
                  block_table=md.block_table.index_select(0, index),
                  slot_mapping=md.slot_mapping.index_select(0, tokens),
                  query_start_loc_cpu=query_start_cpu, seq_lens_cpu=seq_lens_cpu,
                  uniform_decode=max(lens) == 1, step_cache={}, group_metadata=None)
    return sub, tokens


def _step_split(md: AttentionMetadata, threshold: int) -> tuple:
    """Once per step, shared by the layers: (decode metadata or None, the decode tokens' rows or
    None when they are the whole batch, the prefill requests)."""
    key = ("mla_split", threshold)
    if key not in md.step_cache:
        starts = md.query_start_loc_cpu.tolist()
        lens = [starts[i + 1] - starts[i] for i in range(md.num_reqs)]
        decodes, prefills = split_decodes_and_prefills(lens, threshold)
        if not decodes:
            plan = (None, None, prefills)
        elif not prefills and len(decodes) == md.num_reqs:
            plan = (md, None, prefills)
        else:
            plan = (*_sub_metadata(md, decodes), prefills)
        md.step_cache[key] = plan
    return md.step_cache[key]


def _step_chunks(md: AttentionMetadata, requests: list[int], context_lens: list[int],
                 workspace_tokens: int, block_size: int) -> list[tuple]:
    """Once per step, shared by the layers: the context chunks of the prefill `requests`
    (slice.request indexes the requests with context), each with its flat cache rows."""
    key = ("mla_chunks", workspace_tokens)
    if key not in md.step_cache:
        with_context = [i for i, n in zip(requests, context_lens) if n > 0]
        plan = plan_context_chunks([n for n in context_lens if n > 0], workspace_tokens)
        md.step_cache[key] = [(chunk, chunk_rows(chunk, with_context, md.block_table,
                                                 block_size)) for chunk in plan]
    return md.step_cache[key]


class LatentAttentionImpl(TorchAttentionImpl):
    """q [T, nh * (nope + rope)] (roped, not absorbed), k [T, latent + rope] (this step's cache
    rows; v is ignored) -> out [T, nh * v_dim]; kv_b_weight() is kv_b_proj's weight
    [nh * (nope + v_dim), latent], read per call (weights may be reloaded).

    workspace_tokens: the context tokens a prefill step expands at a time; None sizes it from
    the heads and dtype (mla_context_chunks.default_workspace_tokens)."""

    workspace_tokens: int | None = None

    def __init__(self, dims: MLADims, scale: float, kv_b_weight: Callable[[], torch.Tensor],
                 decode_threshold: int = 1):
        super().__init__(dims.num_heads, dims.latent + dims.rope, scale, 1)
        self.dims, self.kv_b_weight = dims, kv_b_weight
        self.v_head_size = dims.latent  # the absorbed MQA's V: the rows' latent part
        self.decode_threshold = decode_threshold

    def forward(self, q, k, v, kv_cache, attn_metadata, out) -> None:
        dims, num_tokens = self.dims, q.shape[0]
        q = q.view(num_tokens, dims.num_heads, dims.qk_dim)
        k = k.view(num_tokens, 1, self.head_size)
        out = out.view(num_tokens, dims.num_heads, dims.v_dim)
        if attn_metadata is None:  # warm-up / profiling: one causal sequence, no cache
            out.copy_(expanded_attention(q, k[:, 0], self.kv_b_weight(), dims, self.scale))
            return
        if kv_cache is None:
            raise RuntimeError("attention has metadata but its layer has no kv_cache; the worker "
                               "must allocate the KV cache before running real steps")
        md, n = attn_metadata, attn_metadata.num_actual_tokens
        self._write_kv(k[:n], None, kv_cache, md.slot_mapping[:n], md.step_cache)
        if n < num_tokens:  # padded batch (CUDA graphs): the padding rows belong to no request
            out[n:].zero_()
        decode_md, decode_tokens, prefills = _step_split(md, self.decode_threshold)
        if prefills:
            self._prefill(q, k, kv_cache, md, out, prefills)
        if decode_md is not None:
            if decode_tokens is None:
                out[:n] = self._absorbed(q[:n], k[:n], kv_cache, decode_md)
            else:
                out.index_copy_(0, decode_tokens, self._absorbed(
                    q.index_select(0, decode_tokens), k.index_select(0, decode_tokens),
                    kv_cache, decode_md))

    def _prefill(self, q, k, kv_cache, md: AttentionMetadata, out, requests) -> None:
        """The expanded form: a fresh prompt over its own rows; requests over cached context
        with that context's rows expanded a bounded chunk at a time, the step's requests'
        slices of a chunk together (vLLM's chunked-context workspace)."""
        dims, w = self.dims, self.kv_b_weight()
        starts, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
        spans = [(starts[i], starts[i + 1]) for i in requests]
        context_lens = [seq_lens[i] - (qe - qs) for i, (qs, qe) in zip(requests, spans)]
        with_context = []
        for (qs, qe), ctx_len in zip(spans, context_lens):
            if ctx_len > 0:
                with_context.append((qs, qe))
            else:
                out[qs:qe] = expanded_attention(q[qs:qe], k[qs:qe, 0], w, dims, self.scale)
        if not with_context:
            return
        workspace = self.workspace_tokens
        if workspace is None:
            workspace = default_workspace_tokens(dims.num_heads, dims.qk_dim, q.dtype.itemsize)
        cache = kv_cache[0].view(-1, self.head_size)  # [nb*bs, L + R]
        plan = _step_chunks(md, requests, context_lens, workspace, kv_cache.shape[2])
        outs = chunked_context_attention(
            [q[qs:qe] for qs, qe in with_context], [k[qs:qe, 0] for qs, qe in with_context],
            ((chunk, cache.index_select(0, rows)) for chunk, rows in plan), w, dims, self.scale)
        for (qs, qe), o in zip(with_context, outs):
            out[qs:qe] = o

    def _absorbed(self, q, k, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        """Decode tokens q [Td, nh, nope + rope], k [Td, 1, L + R] -> [Td, nh, v_dim]: MQA of
        absorbed queries over the latent rows, this step's already in the cache."""
        dims, num_tokens = self.dims, q.shape[0]
        w_uk, w_uv = self.kv_b_weight().view(dims.num_heads, dims.nope + dims.v_dim,
                                             dims.latent).split([dims.nope, dims.v_dim], 1)
        q_latent = torch.bmm(q[..., :dims.nope].transpose(0, 1), w_uk)  # [nh, Td, L]
        qa = torch.cat((q_latent.transpose(0, 1), q[..., dims.nope:]), dim=-1)  # [Td, nh, L+R]
        o = qa.new_empty(num_tokens, dims.num_heads, dims.latent)  # [Td, nh, L]
        self._attend(qa, k, k[..., :dims.latent], kv_cache, md, o)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [Td, nh, v]

    def _write_kv(self, k, v, kv_cache, slot_mapping, step_cache) -> None:
        cache = kv_cache[0].view(-1, 1, self.head_size)  # [nb*bs, 1, L+R]
        slots, owners = _valid_slots(slot_mapping, k.shape[0], step_cache)
        if owners is not None:
            k = k.index_select(0, owners)
        cache.index_copy_(0, slots, k.to(cache.dtype))

    def _read_kv(self, kv_cache, blocks, num_keys: int, dtype) -> tuple:
        k = _gather_context(kv_cache[0], blocks, num_keys).to(dtype)  # [B, 1, S, L+R]
        return k, k[..., :self.v_head_size]


class LatentAttentionBackend(TorchAttentionBackend):
    name = "latent"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return LatentAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return latent_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
