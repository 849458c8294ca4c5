"""`KVCacheManager`: per-request block tables over the block pool, with prefix caching.

The scheduler asks it which leading blocks of a request are already cached, to allocate slots
for the tokens it schedules, and to free a request's blocks when it finishes or is preempted.
When every attention layer is windowed, blocks behind the window go back to the pool as the
request advances (sliding_window_blocks.py); its table keeps None there (NULL_BLOCK_ID to the
runner), so positions keep their slots. A hybrid model's layers form KV cache groups
(kv_cache_groups.py), each with its own table per request over the one pool, all equally long.
"""
from dataclasses import dataclass

from kiln.core.block_pool import BlockPool
from kiln.core.kv_cache_groups import group_blocks_held, longest_group_hit
from kiln.core.kv_cache_utils import KVCacheBlock, cdiv, update_block_hashes
from kiln.core.request import Request
from kiln.core.sliding_window_blocks import num_skipped_blocks

# The block id the runner's table gets for a slot freed behind the window: any valid id, since no
# query reads it and no token is written there again.
NULL_BLOCK_ID = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (one lookup per admitted request)
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: tuple[int | None, ...] | None = None, use_eagle: bool = False):
        """`sliding_window`: the window every attention layer keeps within (kv_window_of);
        None keeps every block of a request until it ends. `group_windows`: each KV cache
        group's window instead (kv_cache_groups.py; None entries: full attention). `use_eagle`:
        an EAGLE head's K/V shares the blocks (prefix hits drop their last block, as vLLM's)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows) if group_windows else (sliding_window,)
        self.num_groups = len(self.group_windows)
        # the window a single group frees behind (None: hybrid, or full attention)
        self.sliding_window = self.group_windows[0] if self.num_groups == 1 else None
        # a request's blocks stay bounded however long it runs
        self.bounded = None not in self.group_windows
        self.use_eagle = use_eagle
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> one table per group (None: a block freed behind the window)
        self.req_to_group_blocks: dict[str, list[list[KVCacheBlock | None]]] = {}
        # req_id -> how many leading blocks of the request were already offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks registered since the last step's forward finished: their K/V is written only
        # by that forward, so a step that fails or is interrupted must take them back.
        self._unwritten: list[KVCacheBlock] = []
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock | None]]:
        """req_id -> group 0's table (the only one without hybrid grouping)."""
        return {req_id: tables[0] for req_id, tables in self.req_to_group_blocks.items()}

    def get_block_ids(self, req_id: str, group: int = 0) -> list[int]:
        tables = self.req_to_group_blocks.get(req_id)
        return [] if tables is None else [NULL_BLOCK_ID if b is None else b.block_id
                                          for b in tables[group]]

    def other_group_block_ids(self, req_id: str, last: int | None = None) -> list[list[int]]:
        """The tables of groups 1.. (empty without hybrid grouping); `last`: only each table's
        last `last` ids (a step's new blocks: every group's table grows alike)."""
        ids = [self.get_block_ids(req_id, g) for g in range(1, self.num_groups)]
        if last is not None:
            ids = [table[len(table) - last:] for table in ids]
        return ids

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_held(self, num_computed: int, num_slots: int) -> int:
        """Blocks a request holds with slots for `num_slots` tokens and its next query at
        `num_computed` (bounded by the window, where the cache frees behind one)."""
        return group_blocks_held(self.group_windows, num_computed, num_slots, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Longest run of leading full blocks found in the prefix cache, and the tokens they hold:
        a list of blocks, or with several groups one such list per group, all as long.

        Never covers the whole request: the last token must be computed to get its logits.
        Pure lookup: no references are taken until `allocate_slots` accepts the blocks. Under a
        window only the blocks the next query's window reads must be cached (freed blocks keep
        their hash until reused); the hit has None before them. Every group must serve the hit
        (longest_group_hit).

        With an EAGLE head the last block found is dropped: the head's K/V at a block's last
        position read the token after the block, which the block's hash does not cover (the
        request that wrote it may have gone on otherwise), so it is computed again.
        """
        if not self._reads_cache(request):
            return ([] if self.num_groups == 1 else [[] for _ in self.group_windows]), 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.block_pool
        lookups = [lambda i, g=g: pool.get_cached_block(hashes[i], g)
                   for g in range(self.num_groups)]
        windows = self.group_windows
        if self.use_eagle:
            # one cached block more than each window reads: the one dropped below
            windows = tuple(None if w is None else w + self.block_size for w in windows)
        hits = longest_group_hit(lookups, windows, max_blocks, self.block_size)
        if self.use_eagle and hits[0]:
            hits = [hit[:-1] for hit in hits]
        num_tokens = len(hits[0]) * self.block_size
        return (hits[0] if self.num_groups == 1 else hits), num_tokens

    def _reads_cache(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed (vLLM skips the cache alike).
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`) for a request being
        admitted; they sit before the new tokens. `num_lookahead_tokens` more slots are held past
        them (a draft model's proposals), never hashed. Returns the ids of group 0's freshly
        allocated blocks (the hits are not included; the other groups' are the same number at
        the end of their tables: other_group_block_ids), or None, changing nothing but the
        blocks behind the window it frees first, when too few blocks are free.
        """
        hits_by_group = [list(h) for h in self._per_group(new_computed_blocks)]
        req_id = request.request_id
        is_new = req_id not in self.req_to_group_blocks
        held = self.req_to_group_blocks.get(req_id) or [[] for _ in self.group_windows]
        num_computed = request.num_computed_tokens + len(hits_by_group[0]) * self.block_size
        for window, hits, blocks in zip(self.group_windows, hits_by_group, held):
            if window is None:
                continue
            # hits behind the window are not taken at all
            skipped = num_skipped_blocks(num_computed, window, self.block_size)
            hits[:skipped] = [None] * min(skipped, len(hits))
            if not is_new:
                self._free_skipped(blocks, skipped)
        num_total = num_computed + num_new_tokens
        num_table = self.num_blocks_for(num_total + num_lookahead_tokens)
        num_new_blocks = [max(0, num_table - len(blocks) - len(hits))
                          for blocks, hits in zip(held, hits_by_group)]
        taken = [b for hits in hits_by_group for b in hits if b is not None]
        # Hits that nobody holds are on the free list too: reviving them uses up free blocks.
        num_revived = sum(1 for b in taken if b.ref_cnt == 0)
        if sum(num_new_blocks) + num_revived > self.block_pool.num_free_blocks:
            return None

        # A prompt's first admission only: a requeued one's return finds its own blocks (and
        # holds generated tokens), and one that skips the cache looked nothing up.
        if is_new and not request.prefix_stats_counted and self._reads_cache(request):
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += len(hits_by_group[0]) * self.block_size
            request.prefix_stats_counted = True
        # Touch the hits before taking new blocks so eviction cannot recycle them under us.
        self.block_pool.touch(taken)
        if is_new:
            self.req_to_group_blocks[req_id] = held
            self._num_cached_blocks[req_id] = len(hits_by_group[0])
        new_ids = []
        for blocks, hits, num in zip(held, hits_by_group, num_new_blocks):
            new_blocks = self.block_pool.get_new_blocks(num)
            blocks.extend(hits)
            blocks.extend(new_blocks)
            new_ids.append([b.block_id for b in new_blocks])
        self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return new_ids[0]

    def _per_group(self, blocks: list | None) -> list[list]:
        """`get_computed_blocks`' hit as one list per group."""
        if not blocks:
            return [[] for _ in self.group_windows]
        return [blocks] if self.num_groups == 1 else list(blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Its full blocks stay findable by hash until reused."""
        tables = self.req_to_group_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        for blocks in tables or ():
            # Tail blocks first: they are the least likely to be shared, so evict them sooner.
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def _free_skipped(self, blocks: list[KVCacheBlock | None], skipped: int) -> None:
        """Give back the request's blocks before index `skipped` (no query reads them again),
        leaving None in their slots. Oldest first, so they are evicted first: a later prompt's
        window hit needs the blocks nearest its end."""
        start = min(skipped, len(blocks))
        while start > 0 and blocks[start - 1] is not None:  # the ones before were freed already
            start -= 1
        freed = blocks[start:skipped]
        blocks[start:skipped] = [None] * len(freed)
        self.block_pool.free_blocks(freed)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def mark_written(self) -> None:
        """The step's forward ran: the blocks registered for it hold their K/V."""
        self._unwritten.clear()

    def forget_unwritten(self) -> None:
        """The step's forward failed or was interrupted: the blocks registered for it may hold
        anything, so no later prompt may hit them."""
        self.block_pool.uncache_blocks(self._unwritten)
        self._unwritten.clear()

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Blocks are registered as soon as they are scheduled full: a request that hits them in
        # the same step reads them only after the attention op wrote the whole batch's K/V.
        if not self.enable_caching:
            return
        req_id = request.request_id
        start = self._num_cached_blocks[req_id]
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        for group, blocks in enumerate(self.req_to_group_blocks[req_id]):
            for i in range(start, num_full):
                if blocks[i] is None:  # freed behind the window before it was offered
                    continue
                self._unwritten.append(blocks[i])  # first: an interrupt may come between the two
                self.block_pool.cache_block(blocks[i], hashes[i], group)
        self._num_cached_blocks[req_id] = num_full
