"""Portable attention in plain torch (CPU and GPU): paged KV write, then causal attention (within
a layer's sliding window, with its scores soft-capped where the layer says so).

Mixed batches loop over requests; a batch of single-token decodes takes batched matmuls. What
every layer would recompute from the metadata is computed once per step (`step_cache`).
"""
import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionBackend, AttentionImpl
from kiln.attention.kv_cache_dtype import from_cache, is_fp8, through_cache, to_cache
from kiln.attention.masking import first_key, key_mask, soft_cap
from kiln.attention.metadata import AttentionMetadata
from kiln.core.kv_cache_utils import cdiv


def _valid_slots(slot_mapping: torch.Tensor, num_tokens: int,
                 step_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots to write, indices of the tokens that own them or None when all do); -1 = nowhere."""
    if step_cache is not None and "slots" in step_cache:
        return step_cache["slots"]
    slots = slot_mapping[:num_tokens]
    valid = slots >= 0
    plan = (slots, None) if bool(valid.all()) else (slots[valid], valid.nonzero().squeeze(1))
    if step_cache is not None:
        step_cache["slots"] = plan
    return plan


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, step_cache: dict | None = None,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter k/v [T, nkv, hd] into kv_cache [2, nb, bs, nkv, hd] at slot_mapping [T]; skip -1.
    An fp8 cache takes them divided by its scales, rounded and saturated (to_cache)."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)  # [nb*bs, nkv, hd]
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
    slots, owners = _valid_slots(slot_mapping, k.shape[0], step_cache)
    if owners is not None:
        k, v = k.index_select(0, owners), v.index_select(0, owners)
    k, v = to_cache(k, key_cache.dtype, k_scale), to_cache(v, value_cache.dtype, v_scale)
    if is_fp8(key_cache.dtype):  # torch's CPU index_copy_ has no fp8 kernel: copy the bytes
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    key_cache.index_copy_(0, slots, k)
    value_cache.index_copy_(0, slots, v)


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [nb, bs, nkv, hd], blocks [B, n] -> contiguous [B, nkv, seq_len, hd].

    One index_select over whole blocks (rows of bs*nkv*hd values) is several times faster on CPU
    than advanced indexing, and the head-major copy is what the matmuls below want anyway."""
    num_blocks, block_size, nkv, hd = cache.shape
    batch, n = blocks.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks.reshape(-1))  # [B*n, bs*nkv*hd]
    seq = rows.view(batch, n * block_size, nkv, hd)[:, :seq_len]  # [B, S, nkv, hd]
    return seq.transpose(1, 2).contiguous()


class TorchAttentionImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, attn_metadata, out) -> None:
        num_tokens = q.shape[0]
        q, k, v, out = self._heads(q, k, v, out)
        if attn_metadata is None:
            self._whole_batch_causal(q, k, v, out)
            return
        if kv_cache is None:
            raise RuntimeError("attention has metadata but its layer has no kv_cache; the worker "
                               "must allocate the KV cache before running real steps")
        n = attn_metadata.num_actual_tokens
        if n < num_tokens:  # padded batch (CUDA graphs): the padding rows belong to no request
            self._write_kv(k[:n], v[:n], kv_cache, attn_metadata.slot_mapping[:n],
                           attn_metadata.step_cache)
            out[n:].zero_()
        else:
            self._write_kv(k, v, kv_cache, attn_metadata.slot_mapping, attn_metadata.step_cache)
        self._attend(q, k, v, kv_cache, attn_metadata, out)

    def _heads(self, q, k, v, out) -> tuple:
        """The op's rows split into heads: q, out [T, nh, hd]; k, v [T, nkv, hd]."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_size
        num_tokens = q.shape[0]
        return (q.view(num_tokens, nh, hd), k.view(num_tokens, nkv, hd),
                v.view(num_tokens, nkv, hd), out.view(num_tokens, nh, hd))

    def _write_kv(self, k, v, kv_cache, slot_mapping, step_cache) -> None:
        write_kv_cache(k, v, kv_cache, slot_mapping, step_cache, self.k_scale, self.v_scale)

    def _read_kv(self, kv_cache, blocks, num_keys: int, dtype) -> tuple:
        """Keys and values of `blocks` [B, n], their first num_keys slots: [B, nkv, S, hd]."""
        return (from_cache(_gather_context(kv_cache[0], blocks, num_keys), dtype, self.k_scale),
                from_cache(_gather_context(kv_cache[1], blocks, num_keys), dtype, self.v_scale))

    def _attend(self, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        """Attention of the real tokens, with this step's k/v already in the cache."""
        if md.uniform_decode or md.max_query_len == 1:
            self._batched_decode(q, kv_cache, md, out)
        else:
            self._per_request(q, k, v, kv_cache, md, out, range(md.num_reqs))

    def _whole_batch_causal(self, q, k, v, out) -> None:
        # Warm-up / profiling: the batch is one causal sequence; the cache is left alone.
        qh = q.transpose(0, 1)  # [nh, T, hd]
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [nkv, T, hd]
        pos = torch.arange(q.shape[0], device=q.device)
        out.copy_(self._masked(qh, kh, vh, pos, pos).transpose(0, 1))

    def _masked(self, qh, kh, vh, query_pos, key_pos) -> torch.Tensor:
        """qh [nh, L, hd] at query_pos [L] against kh/vh [nkv, S, hd] at key_pos [S]: causal,
        within the layer's window, scores soft-capped where it has a cap -> [nh, L, hd]."""
        if self.logits_soft_cap is None:
            # A sequence against itself (its callers pass one tensor): plain causal SDPA, which
            # a value comparison (torch.equal) would reach only after a device sync per layer
            if self.sliding_window is None and key_pos is query_pos:
                return self._sdpa(qh, kh, vh, is_causal=True)
            return self._sdpa(qh, kh, vh, attn_mask=key_mask(query_pos, key_pos,
                                                             self.sliding_window))
        # SDPA has no soft cap: the scores in float32, capped, masked, softmaxed (HF's eager).
        nkv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        qg = qh.reshape(nkv, group * qh.shape[1], -1)  # [nkv, group*L, hd]
        scores = torch.matmul(qg, kh.transpose(-1, -2)).float() * self.scale  # [nkv, group*L, S]
        scores = soft_cap(scores, self.logits_soft_cap).view(nkv, group, qh.shape[1], -1)
        scores.masked_fill_(~key_mask(query_pos, key_pos, self.sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vh.dtype).view(nkv, group * qh.shape[1], -1)
        return torch.matmul(probs, vh).view(*qh.shape[:-1], vh.shape[-1])

    def _sdpa(self, qh, kh, vh, **mask) -> torch.Tensor:
        """SDPA over one sequence: qh [nh, L, hd], kh/vh [nkv, S, hd] -> [nh, L, hd]. Given a
        batch dim, CPU torch takes its flash kernel (3-D inputs fall back to the math path:
        measured 6x slower for a 2048-token prompt, 3x for 16 tokens)."""
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], scale=self.scale,
                                           enable_gqa=self.num_heads > self.num_kv_heads, **mask)
        return o[0]

    def _per_request(self, q, k, v, kv_cache, md: AttentionMetadata, out, requests) -> None:
        block_size = kv_cache.shape[2]
        starts = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens_cpu.tolist()
        for i in requests:
            qs, qe, seq_len = starts[i], starts[i + 1], seq_lens[i]
            q_len = qe - qs
            if q_len == 0:
                continue
            ctx_len = seq_len - q_len
            qh = q[qs:qe].transpose(0, 1)  # [nh, q_len, hd]
            # Query j sits at absolute position ctx_len + j and sees keys up to it (within its
            # window: blocks wholly before the first query's window are not read).
            query_pos = torch.arange(ctx_len, seq_len, device=q.device)
            if ctx_len == 0:
                # A fresh prefill attends only to its own tokens: they are this step's k/v, no
                # need to read them back out of the cache (as an fp8 cache holds them, so that
                # every path attends over the same keys).
                kh = through_cache(k[qs:qe], kv_cache.dtype, self.k_scale).transpose(0, 1)
                vh = through_cache(v[qs:qe], kv_cache.dtype, self.v_scale).transpose(0, 1)
                key_pos = query_pos
            else:
                first_block = first_key(ctx_len, self.sliding_window) // block_size
                num_blocks = cdiv(seq_len, block_size)
                blocks = md.block_table[i:i + 1, first_block:num_blocks].long()  # [1, n]
                start = first_block * block_size
                kh, vh = (t[0] for t in self._read_kv(kv_cache, blocks, seq_len - start,
                                                      q.dtype))
                key_pos = torch.arange(start, seq_len, device=q.device)  # [S]
            out[qs:qe] = self._masked(qh, kh, vh, query_pos, key_pos).transpose(0, 1)

    def _batched_decode(self, q, kv_cache, md: AttentionMetadata, out) -> None:
        # One query per request: plain batched matmuls, grouping the query heads that share a KV
        # head, beat SDPA's CPU kernel (built for long queries) several times over.
        nkv, hd = self.num_kv_heads, self.head_size
        group = self.num_heads // nkv
        num_reqs = md.num_reqs
        # a windowed layer reads each request's window's blocks only (those before it may be
        # back in the pool, another request's now); else the whole context, padded
        blocks, padding = _decode_plan(md, kv_cache.shape[2], self.sliding_window)
        num_keys = padding.shape[-1]
        k, v = self._read_kv(kv_cache, blocks, num_keys, q.dtype)  # [B, nkv, S, hd]
        # Slots past a request's length (or before its window) hold whatever their block held,
        # an inf or NaN of a float16 overflow too: masked, not added to (NaN + -inf is NaN), and
        # V zeroed there (0 * NaN is NaN).
        v.masked_fill_(padding.transpose(-1, -2), 0)
        qg = q[:num_reqs].view(num_reqs, nkv, group, hd) * self.scale
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, nkv, group, S]
        scores = soft_cap(scores, self.logits_soft_cap)
        scores.masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        o = torch.matmul(probs, v)  # [B, nkv, group, hd of V]
        out[:num_reqs] = o.view(num_reqs, nkv * group, -1)


def _decode_plan(md: AttentionMetadata, block_size: int,
                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step and window, shared by their layers: the blocks each request reads [B, n] (int64)
    and the mask [B, 1, 1, n * block_size] of the keys it must not see (past its length, before
    its window). With a window, n is the most blocks a window spans and a request's first is its
    window's; without, its blocks from the first, as many as the longest request's."""
    num_reqs, max_seq = md.num_reqs, md.max_seq_len
    num_blocks = cdiv(max_seq, block_size)
    key = ("decode", block_size, window)
    if key not in md.step_cache:
        seq_lens = md.seq_lens[:num_reqs, None]  # [B, 1]
        if window is None or window_blocks(window, block_size) >= num_blocks:
            # no window, or one that spans every block: the context from its first block
            blocks = md.block_table[:num_reqs, :num_blocks].long()
            key_pos = torch.arange(max_seq, device=seq_lens.device)[None, :]  # [1, S]
            hidden = key_pos >= seq_lens  # [B, S]
            if window is not None:
                hidden = hidden | (key_pos < seq_lens - window)
        else:
            num_blocks = window_blocks(window, block_size)
            first = (seq_lens - window).clamp(min=0) // block_size  # [B, 1]
            cols = first + torch.arange(num_blocks, device=seq_lens.device)  # [B, n]
            # columns past a short request's table are past its length, so only masked
            cols = cols.clamp(max=md.block_table.shape[1] - 1)
            blocks = md.block_table[:num_reqs].gather(1, cols.to(torch.int64)).long()
            key_pos = first * block_size + torch.arange(num_blocks * block_size,
                                                        device=seq_lens.device)  # [B, S]
            hidden = (key_pos >= seq_lens) | (key_pos < seq_lens - window)
        md.step_cache[key] = (blocks, hidden[:, None, None, :])
    return md.step_cache[key]


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a decoding query's window (its last `window` keys) spans."""
    return cdiv(window - 1, block_size) + 1


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_full_cudagraph = False

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl
