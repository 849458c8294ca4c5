"""Per-step attention metadata: what the attention op needs to find each request's KV blocks.

Built by the model runner once per step; read by every layer's attention through the forward
context, so none of it is baked into the traced graph.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens of real requests (the rest of the batch is padding)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # Tensors on the model's device. Rows follow the batch order of the runner's input ids.
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length incl. this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot per token; -1: write nowhere
    # Host copies, so a backend can loop over requests without device syncs.
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    # True when every request decodes one token (enables the batched decode path).
    uniform_decode: bool = False
    # Tensors a backend derives from the above once per step (begin_step or first layer) and
    # every layer reuses: gather indices, masks. Keyed by the backend; never part of a traced graph.
    step_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # Every KV cache group's metadata (kiln/core/kv_cache_groups.py), this one first, each with
    # its own block table and slots over the same requests; None with one group.
    group_metadata: list["AttentionMetadata"] | None = field(default=None, repr=False,
                                                            compare=False)
