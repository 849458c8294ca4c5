"""Which KV blocks a request still needs when every attention layer is windowed: pure functions
the KV cache manager (freeing, prefix hits) and the capacity checks (scheduler, engine) share.

A query at position p reads keys from first_key(p, window) on (kiln/attention/masking.py), so
the blocks wholly before the first query of a step are never read again and go back to the pool.
"""
from collections.abc import Callable, Iterable
from typing import TypeVar

from kiln.attention.masking import first_key
from kiln.core.kv_cache_utils import cdiv

Block = TypeVar("Block")


def kv_window(windows: Iterable[int | None]) -> int | None:
    """The window the KV cache may free blocks behind: the largest layer window when every layer
    has one, else None (a hybrid model's full-attention layers read every block, and they share
    the block table with the windowed ones)."""
    windows = list(windows)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def kv_window_of(kiln_config) -> int | None:
    """`kv_window` over the target model's layers and, with a draft model, the draft's too (it
    reads the same block tables)."""
    models = [kiln_config.model_config]
    spec = getattr(kiln_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None:
        models.append(draft)
    windows = [m.layer_sliding_window(i) for m in models for i in range(m.num_layers)]
    return kv_window(windows)


def prompt_tokens_cached(kiln_config, num_blocks: int) -> int | None:
    """The longest prompt a KV cache of `num_blocks` ever holds (None: no bound past
    max_model_len): under a window every layer keeps, a request holds a bounded number of blocks
    however long it is, which the engine core already fit max_model_len to (peak_blocks)."""
    if kv_window_of(kiln_config) is not None:
        return None
    return num_blocks * kiln_config.cache_config.block_size


def num_skipped_blocks(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks no query at position `num_computed` or later reads: every key in them lies
    before the first query's window. Drafts and a draft model's catch-up start at num_computed
    too, so they read nothing earlier."""
    return first_key(num_computed, window) // block_size


def blocks_held(num_computed: int, num_slots: int, window: int | None, block_size: int) -> int:
    """Real blocks a request holds once it has slots for `num_slots` tokens (lookahead included)
    and its next query is at `num_computed`."""
    total = cdiv(num_slots, block_size)
    if window is None:
        return total
    return total - min(total, num_skipped_blocks(num_computed, window, block_size))


def peak_blocks(num_tokens: int, chunk: int, lookahead: int, window: int | None,
                block_size: int) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once while they are computed in
    steps of at most `chunk` tokens (the token budget), `lookahead` slots past each step.

    Full attention: every block (`lookahead` left out, as the scheduler always counted it).
    Windowed: a step at position c holds its window's blocks and the step's, at most
    cdiv(window + chunk + lookahead + block_size - 2, block_size) however far c is (c - window + 1
    may fall just past a block start), which decoding (chunk 1) never exceeds either."""
    if window is None:
        return cdiv(num_tokens, block_size)
    bounded = cdiv(window + chunk + lookahead + block_size - 2, block_size)
    return min(cdiv(num_tokens + lookahead, block_size), bounded)


def window_hit_blocks(window: int, block_size: int) -> int:
    """Blocks right before a prefix hit's end that must be cached for the hit to be usable: those
    the window of the first query after it reads (the query's own key is computed, not hit)."""
    return cdiv(window - 1, block_size)


def longest_window_hit(lookup: Callable[[int], Block | None], max_blocks: int, window: int,
                       block_size: int) -> list[Block | None]:
    """The longest prefix hit of at most `max_blocks` blocks under a window: block i is
    `lookup(i)` (None: not cached). Only the last `window_hit_blocks` of the hit must be cached;
    the blocks before them are None in the result (no query reads them)."""
    needed = window_hit_blocks(window, block_size)
    if needed == 0:  # a window of 1: the next query reads its own key only
        return [None] * max_blocks
    found: dict[int, Block] = {}
    run = 0  # cached blocks found in a row, going left from the right end
    for i in range(max_blocks - 1, -1, -1):
        block = lookup(i)
        if block is None:
            run = 0
            continue
        found[i] = block
        run += 1
        if run >= needed:  # blocks i .. i + run - 1 are the hit's tail
            return [found.get(j) if j >= i else None for j in range(i + run)]
    # no run long enough: only a run from block 0 is a hit (its window starts at key 0)
    hit = []
    for i in range(max_blocks):
        if i not in found:
            break
        hit.append(found[i])
    return hit
