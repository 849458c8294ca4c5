"""Per-request state held by the model runner, and its persistent host-side tables.

`InputBatch` keeps, per live request, a row of token ids and of block ids in preallocated
numpy arrays, so each step's inputs are gathered with vectorised indexing.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    row: int = field(default=-1)  # row in InputBatch's tables
    lora_request: object = None  # kiln.lora.request.LoRARequest; None: the base model
    # KV cache groups 1..'s tables, each as long as block_ids (kiln/core/kv_cache_groups.py)
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Token ids [max_num_seqs, max_model_len + 1] and block ids [max_num_seqs, max_blocks] per
    KV cache group (`block_tables` [groups, max_num_seqs, max_blocks]; `block_table` group 0's);
    every group's row is equally long (`num_blocks`)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int,
                 num_groups: int = 1):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        # One spare column: the token sampled at max_model_len is reported but never run.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_req),
                                     dtype=np.int32)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, state: CachedRequestState) -> int:
        if not self._free_rows:
            raise RuntimeError(f"the model runner already holds max_num_seqs={self.max_num_seqs} "
                               f"requests; cannot add {state.req_id!r} (scheduler bug?)")
        n = state.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {n} tokens, more than "
                             f"max_model_len={self.max_model_len}; raise --max-model-len")
        row = self._free_rows.pop()  # only once nothing can refuse it
        self.token_ids[row, :len(state.prompt_token_ids)] = state.prompt_token_ids
        self.token_ids[row, len(state.prompt_token_ids):n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        state.row = row
        self.append_block_ids(row, state.block_ids, state.group_block_ids)
        return row

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def append_block_ids(self, row: int, block_ids: list[int],
                         group_block_ids: list[list[int]] = ()) -> None:
        """Group 0's new ids, and groups 1..'s (as many each)."""
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"block table row overflow: {end} blocks > max_blocks_per_req="
                             f"{self.max_blocks_per_req} (max_model_len / block_size)")
        if len(group_block_ids) != len(self.block_tables) - 1:
            raise ValueError(f"{len(group_block_ids) + 1} KV cache groups' block ids for a "
                             f"runner of {len(self.block_tables)} (scheduler / runner mismatch)")
        self.block_table[row, start:end] = block_ids
        for table, ids in zip(self.block_tables[1:], group_block_ids):
            table[row, start:end] = ids
        self.num_blocks[row] = end

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n > self.max_model_len:
            raise ValueError(f"request in row {row} ran past max_model_len={self.max_model_len} "
                             "(the scheduler should have finished it)")
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
