"""Pure functions that turn a step's schedule into flat model inputs (numpy, no state).

Batch layout (docs/architecture.md, "Contracts"): requests one after another, each contributing
its scheduled tokens; a token's position is its index in the request's sequence; padding has
slot -1.
"""
import numpy as np


def query_start_loc(num_scheduled: np.ndarray) -> np.ndarray:
    """[R] tokens per request -> [R + 1] int32 cumulative offsets starting at 0."""
    out = np.zeros(len(num_scheduled) + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=out[1:])
    return out


def token_request_indices(num_scheduled: np.ndarray) -> np.ndarray:
    """[T] the batch row (0..R-1) each flat token belongs to."""
    return np.repeat(np.arange(len(num_scheduled), dtype=np.int64), num_scheduled)


def positions(num_computed: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray:
    """[T] int64 positions: request r runs num_computed[r] .. num_computed[r] + num_scheduled[r]."""
    req_idx = token_request_indices(num_scheduled)
    starts = query_start_loc(num_scheduled)[:-1]
    offsets = np.arange(req_idx.size, dtype=np.int64) - starts[req_idx]
    return num_computed.astype(np.int64)[req_idx] + offsets


def slot_mapping(block_table: np.ndarray, req_idx: np.ndarray, pos: np.ndarray,
                 block_size: int) -> np.ndarray:
    """[T] int64 cache slot of each token: block_table[req][pos // bs] * bs + pos % bs.
    block_table: [R, max_blocks] rows in batch order."""
    blocks = block_table[req_idx, pos // block_size].astype(np.int64)
    return blocks * block_size + pos % block_size


def logits_indices(qsl: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Flat index of the last scheduled token of every request that samples this step."""
    return (qsl[1:] - 1)[samples].astype(np.int64)


def as_slice(indices: np.ndarray) -> slice | None:
    """Increasing `indices` as a slice when they are consecutive (a decode step's logits rows),
    else None: a slice takes a view where a tensor index gathers (aten::index, ~40 us on CPU)."""
    if indices.size == 0 or indices[-1] - indices[0] != indices.size - 1:
        return None
    return slice(int(indices[0]), int(indices[-1]) + 1)


def check_step(req_ids: list[str], num_computed: np.ndarray, num_scheduled: np.ndarray,
               num_known: np.ndarray, num_blocks: np.ndarray, block_size: int) -> None:
    """Raise if the scheduler sent a step the runner's tables cannot hold: tokens past those
    it knows, or positions past the blocks it holds (a scheduler / runner mismatch)."""
    end = num_computed + num_scheduled  # [R]
    over = np.nonzero(end > num_known)[0]
    if over.size:
        i = int(over[0])
        raise RuntimeError(f"request {req_ids[i]!r} scheduled {num_scheduled[i]} tokens from "
                           f"position {num_computed[i]} but only {num_known[i]} tokens are known")
    short = np.nonzero((end - 1) // block_size >= num_blocks)[0]
    if short.size:
        i = int(short[0])
        raise RuntimeError(f"request {req_ids[i]!r} runs to position {end[i] - 1} but holds "
                           f"only {num_blocks[i]} KV blocks of {block_size}")


def sampling_mask(num_computed: np.ndarray, num_scheduled: np.ndarray,
                  num_tokens: np.ndarray) -> np.ndarray:
    """[R] bool: the step reaches the end of the request's known tokens (a partial prefill
    chunk does not, and samples nothing)."""
    return num_computed + num_scheduled >= num_tokens
