"""CPU attention: the torch backend with its attention in Kiln's C kernels, which read each
request's K/V blocks in place: short queries (decodes, small chunks) in the per-token kernel,
which also writes the step's K/V into the cache, long ones (prefills) in the blocked one.

A step is handed to the op's C++ kernel before its first layer (begin_step), and its layers
reach the C kernels without Python, unless SDPA takes some of its queries. Both kernels take a layer's
sliding window and soft cap. Long queries stay on SDPA where
the blocked kernel has no SIMD tiles for the layer (its scalar path is slower than SDPA).
"""
from typing import NamedTuple

import torch

from kiln.attention import kv_cache_generation
from kiln.attention.backend import AttentionImpl
from kiln.attention.metadata import AttentionMetadata
from kiln.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl
from kiln.forward_context import get_forward_context, is_forward_context_available
from kiln.native import attention_op, paged_attention, prefill_attention

# Queries up to this many tokens go to the per-token kernel (a decode is 1): below it the blocked
# kernel's 16-token lanes sit mostly idle and the per-token one is as fast (they meet at ~4
# tokens, measured), and a step of such queries only skips Python in every layer (begin_step).
KERNEL_MAX_QUERY_LEN = 8


class Routes(NamedTuple):
    """A step's requests by where their queries are attended."""
    short: list[int]  # the per-token kernel
    prefill: list[int]  # the blocked kernel
    sdpa: list[int]  # torch's SDPA, per request


def split_requests(query_lens: list[int], prefill_kernel: bool = True,
                   max_kernel_len: int = KERNEL_MAX_QUERY_LEN) -> Routes:
    """Requests by query length: short ones to the per-token kernel, long ones to the blocked
    kernel when it has SIMD tiles for the layer (`prefill_kernel`), else to SDPA; empty queries
    in none."""
    short = [i for i, n in enumerate(query_lens) if 0 < n <= max_kernel_len]
    long = [i for i, n in enumerate(query_lens) if n > max_kernel_len]
    return Routes(short, long, []) if prefill_kernel else Routes(short, [], long)


class CpuAttentionImpl(TorchAttentionImpl):
    # A decode step calls this once per layer, so the step's metadata is gathered once a step
    # (begin_step, else at its first layer) and a call crosses into C++ once, for the K/V write
    # and the attention together (measured in the engine at one decode token, this method: ~60
    # us a layer with per-call checks and two calls, ~28 with one call).

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        attention_op.available()  # built (once) and registered before any step runs

    def forward(self, q, k, v, kv_cache, attn_metadata, out) -> None:
        md = attn_metadata
        if (md is None or kv_cache is None
                or not paged_attention.cache_supported(kv_cache, q.dtype)):
            super().forward(q, k, v, kv_cache, md, out)
            return
        plan = self._plan(md, kv_cache.shape[2], q.dtype, self.head_size)
        # Writes every real token's k/v, then attends the short queries.
        window, cap = self.sliding_window, self.logits_soft_cap
        ks, vs = self.k_scale, self.v_scale  # an fp8 cache's
        paged_attention.run(q, k, v, out, kv_cache, plan.short, self.scale, window, cap, ks, vs)
        if plan.prefill is not None:  # their k/v are in the cache now
            prefill_attention.run(q, out, kv_cache, plan.prefill, self.scale, window=window,
                                  softcap=cap, k_scale=ks, v_scale=vs)
        num_tokens = q.shape[0]
        if plan.sdpa:
            nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_size
            self._per_request(q.view(num_tokens, nh, hd), k.view(num_tokens, nkv, hd),
                              v.view(num_tokens, nkv, hd), kv_cache, md,
                              out.view(num_tokens, nh, hd), plan.sdpa)
        if md.num_actual_tokens < num_tokens:  # padding rows (CUDA graphs) belong to no request
            out[md.num_actual_tokens:].zero_()

    @staticmethod
    def _plan(md: AttentionMetadata, block_size: int, dtype: torch.dtype | None = None,
              head_size: int | None = None) -> "_StepPlan":
        """The kernels' arguments for the step, once per step (and layer kind), shared by every
        layer. A step with no query for SDPA is handed to the C++ kernel as it is planned."""
        simd = dtype is None or prefill_attention.simd(dtype, head_size)
        key = ("cpu_split", simd)
        if key not in md.step_cache:
            starts = md.query_start_loc_cpu[:md.num_reqs + 1].tolist()
            routes = split_requests([e - s for s, e in zip(starts, starts[1:])], simd)
            every = len(starts) - 1

            def args(reqs: list[int]) -> paged_attention.StepArgs:
                return paged_attention.StepArgs(
                    md.block_table, md.query_start_loc, md.seq_lens, _int32_tensor(reqs, every),
                    md.max_seq_len, block_size, md.slot_mapping, md.num_actual_tokens)

            plan = _StepPlan(args(routes.short), args(routes.prefill) if routes.prefill else None,
                             routes.sdpa)
            md.step_cache[key] = plan
            if not routes.sdpa:
                _hand_over(md, plan.short, plan.prefill.reqs if plan.prefill else None)
        return md.step_cache[key]


class _StepPlan(NamedTuple):
    short: paged_attention.StepArgs  # every real token's slot; the short queries' requests
    prefill: paged_attention.StepArgs | None  # the long queries' requests, if any
    sdpa: list[int]  # the long queries' requests where the blocked kernel has no SIMD tiles


_arange = torch.arange(0, dtype=torch.int32)


def _int32_tensor(indices: list[int], every: int) -> torch.Tensor:
    """`indices` (ascending, below `every`) as an int32 tensor; when they are all of 0..every-1,
    the usual step, a slice of a kept arange (torch.tensor of a list took ~25 us in a step)."""
    global _arange
    if len(indices) != every:
        return torch.tensor(indices, dtype=torch.int32)
    if _arange.numel() < every:
        _arange = torch.arange(max(every, 2 * _arange.numel()), dtype=torch.int32)
    return _arange[:every]


def kernel_layers(layers: dict) -> dict[str, attention_op.LayerEntry]:
    """The layers the C++ kernel serves: each CPU attention layer whose KV cache it reads, of
    any KV cache group (kiln/core/kv_cache_groups.py; each attends with its group's block table
    and slots, group_steps)."""
    entries = {}
    for name, layer in layers.items():
        impl, kv_cache = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        if (isinstance(impl, CpuAttentionImpl) and kv_cache is not None
                and paged_attention.cache_supported(kv_cache)):
            entries[name] = attention_op.LayerEntry(kv_cache, getattr(layer, "kv_group", 0),
                                                    impl.scale, impl.sliding_window,
                                                    impl.logits_soft_cap, impl.k_scale,
                                                    impl.v_scale)
    return entries


def group_steps(md: AttentionMetadata,
                step: paged_attention.StepArgs) -> list[paged_attention.StepArgs]:
    """`step` (KV cache group 0's, from `md`) for every group: the same requests with each
    group's block table and slots (md.group_metadata); [step] with one group."""
    groups = md.group_metadata or [md]
    return [step] + [paged_attention.StepArgs(
        g.block_table, step.query_start_loc, step.seq_lens, step.reqs, step.max_seq_len,
        step.block_size, g.slot_mapping, step.num_tokens) for g in groups[1:]]


# id(an engine's layer dict) -> (the KV caches' generation when built, its LayerTable); a few
# engines at most share a process.
_tables: dict[int, tuple[int, attention_op.LayerTable]] = {}
_MAX_TABLES = 8


def _layer_table(layers: dict) -> attention_op.LayerTable | None:
    """The C++ kernel's table of kernel_layers, rebuilt after any layer's cache was assigned
    anew; None when it can serve none."""
    generation = kv_cache_generation.current()
    known = _tables.get(id(layers))
    if known is not None and known[0] == generation:
        return known[1]
    entries = kernel_layers(layers)
    table = attention_op.LayerTable(entries) if entries else None
    if len(_tables) >= _MAX_TABLES:
        _tables.pop(next(iter(_tables)))
    _tables[id(layers)] = (generation, table)
    return table


def _hand_over(md: AttentionMetadata, step: paged_attention.StepArgs,
               prefill_reqs: torch.Tensor | None) -> None:
    """Let the C++ kernel of kiln::unified_attention serve the step's other layers, each with
    its KV cache group's `step` (group_steps) and, where the step has long queries, the prefill
    kernel over `prefill_reqs`, until the forward context closes (kiln/native/attention_op.py)."""
    if not (attention_op.available() and is_forward_context_available()):
        return
    context = get_forward_context()
    if context.attn_metadata is not md:
        return
    table = _layer_table(context.no_compile_layers)
    if table is not None:
        attention_op.begin_step(table, group_steps(md, step), md.num_actual_tokens,
                                prefill_reqs)
        context.on_exit.append(attention_op.end_step)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @staticmethod
    def begin_step(attn_metadata: AttentionMetadata, block_size: int) -> None:
        # Planned (and handed to the C++ kernel) before the first layer, every layer of the step
        # skips Python: the first one's plan and checks took ~110 of its ~125 us in a decode
        # step. Planned for the prefill kernel's SIMD tiles; a layer they do not serve goes
        # back to Python, which plans SDPA's share for it.
        CpuAttentionImpl._plan(attn_metadata, block_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuAttentionImpl
