"""Python side of the C++ CPU kernel of `kiln::unified_attention` (csrc/unified_attention_op.cpp):
handing it each step's metadata and an engine's table of layers (a torch custom-class object).

The C++ kernel serves a step's layers only once a step was handed over (`begin_step`), and only
those in the table; every other call goes to the Python implementation.
"""
from typing import NamedTuple

import torch

from kiln.native import build, paged_attention

KINDS = ("kernel", "python")  # the C++ kernel's calls: served there, sent to Python


def available() -> bool:
    """The kernels built and loaded; False (with one warning) when they cannot be built."""
    return build.available()


class LayerEntry(NamedTuple):
    """A layer as the C++ kernel serves it."""
    kv_cache: torch.Tensor  # [2, nb, bs, nkv, hd], held weakly there: a replaced one is freed
    group: int  # its KV cache group (kiln/core/kv_cache_groups.py): the step it attends with
    scale: float
    window: int | None  # None: no sliding window
    softcap: float | None  # attention logit soft cap; None: none
    k_scale: float = 1.0  # an fp8 cache's per-tensor scales (kiln/attention/kv_cache_scales.py)
    v_scale: float = 1.0


class LayerTable:
    """An engine's layers as the C++ kernel finds them by name."""

    def __init__(self, layers: dict[str, LayerEntry]):
        entries = list(layers.values())
        self.layers = torch.classes.kiln.AttentionLayers(
            list(layers), [e.kv_cache for e in entries], [int(e.group) for e in entries],
            [float(e.scale) for e in entries], [int(e.window or 0) for e in entries],
            [float(e.softcap or 0.0) for e in entries], [float(e.k_scale) for e in entries],
            [float(e.v_scale) for e in entries])


def begin_step(table: LayerTable, steps: list[paged_attention.StepArgs],
               num_actual_tokens: int, prefill_reqs: torch.Tensor | None = None) -> None:
    """Until `end_step`, calls for the table's layers attend with their group's step of `steps`
    (one per KV cache group, over the same requests: only the block table and slot mapping
    differ; the C++ side holds their tensors until then); rows from num_actual_tokens on are
    padding, zeroed. prefill_reqs (int32): the step's long queries' requests, which the prefill
    kernel then attends after each layer's K/V write (a layer whose dtype and head size it has
    no SIMD tiles for takes the Python path, SDPA). A layer of a group past `steps` takes the
    Python path."""
    first = steps[0]
    _, query_start_loc, seq_lens, reqs, _, num_tokens, max_seq_len = first.tensors()
    torch.ops.kiln.attention_begin_step(
        table.layers, [s.block_table for s in steps], query_start_loc, seq_lens, reqs,
        [s.slot_mapping for s in steps], num_tokens, max_seq_len, first.block_size,
        num_actual_tokens, prefill_reqs)


def end_step() -> None:
    torch.ops.kiln.attention_end_step()


def call_counts() -> dict[str, int]:
    """The C++ kernel's calls so far (process-wide) by where they were served."""
    return dict(zip(KINDS, torch.ops.kiln.attention_call_counts()))
