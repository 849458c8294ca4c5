"""Test helper: paged KV caches and AttentionMetadata for hand-made batches of requests.

Mirrors what the model runner does each step: batch order = requests one after another.
"""
from dataclasses import dataclass, field

import torch

from kiln.attention.metadata import AttentionMetadata
from kiln.forward_context import set_forward_context
from kiln.model.layers.attention import attention_layers


def allocate_kv_caches(model, kiln_config, num_blocks: int, block_size: int,
                       dtype: torch.dtype | None = None) -> None:
    """Give every Attention layer of the built model a zeroed paged cache."""
    dtype = dtype or kiln_config.model_config.torch_dtype
    for layer in attention_layers(model).values():
        shape = layer.backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads,
                                                 layer.head_size)
        layer.kv_cache = torch.zeros(shape, dtype=dtype)


@dataclass
class PagedRequest:
    """One request's tokens and block table; blocks come from a shared pool in a scrambled order."""
    token_ids: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # Scrambled so a request's blocks are not contiguous (exercises the block table).
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.block_size = block_size

    def ensure(self, req: PagedRequest, num_tokens: int) -> None:
        while len(req.blocks) * self.block_size < num_tokens:
            req.blocks.append(self.free.pop())


def build_step(pool: BlockPool, reqs: list[PagedRequest], query_lens: list[int],
               num_padding: int = 0, max_blocks_per_req: int = 64):
    """input_ids [T], positions [T], AttentionMetadata for one step; advances num_computed.

    Request i contributes tokens [num_computed, num_computed + query_lens[i]); padding tokens
    (slot -1) are appended after the real ones, as a runner padding to a graph size would.
    """
    bs = pool.block_size
    ids, pos, slots, starts, seq_lens = [], [], [], [0], []
    table = torch.zeros(len(reqs), max_blocks_per_req, dtype=torch.int32)
    for i, (req, q_len) in enumerate(zip(reqs, query_lens)):
        start, end = req.num_computed, req.num_computed + q_len
        pool.ensure(req, end)
        for p in range(start, end):
            ids.append(req.token_ids[p])
            pos.append(p)
            slots.append(req.blocks[p // bs] * bs + p % bs)
        table[i, :len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        starts.append(starts[-1] + q_len)
        seq_lens.append(end)
        req.num_computed = end
    num_actual = len(ids)
    ids += [0] * num_padding
    pos += [0] * num_padding
    slots += [-1] * num_padding
    qsl = torch.tensor(starts, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=num_actual, num_reqs=len(reqs), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.clone(), seq_lens=sl.clone(),
        block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=sl,
        uniform_decode=all(q == 1 for q in query_lens))
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), md)


def run_step(model, kiln_config, input_ids, positions, attn_metadata) -> torch.Tensor:
    """Forward one step inside a forward context; returns float32 logits for every token."""
    with torch.no_grad(), set_forward_context(attn_metadata, kiln_config,
                                                    layers=attention_layers(model)):
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden)


def greedy_generate(model, kiln_config, prompt: list[int], max_new_tokens: int,
                    num_blocks: int = 64, block_size: int = 16) -> list[int]:
    """Greedy tokens after `prompt`: one prefill step, then one decode step per token."""
    allocate_kv_caches(model, kiln_config, num_blocks, block_size)
    pool = BlockPool(num_blocks, block_size)
    req = PagedRequest(list(prompt))
    new_tokens: list[int] = []
    query_len = len(prompt)
    for _ in range(max_new_tokens):
        ids, pos, md = build_step(pool, [req], [query_len])
        logits = run_step(model, kiln_config, ids, pos, md)
        token = int(logits[-1].argmax())
        new_tokens.append(token)
        req.token_ids.append(token)
        query_len = 1
    return new_tokens


def kiln_config_for(model_path, dtype: str = "float32", **kwargs):
    """A CPU, eager KilnConfig for a local checkpoint (dir or .gguf)."""
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig

    return KilnConfig(ModelConfig(model=str(model_path), dtype=dtype, **kwargs),
                      device_config=DeviceConfig("cpu"), enforce_eager=True)
