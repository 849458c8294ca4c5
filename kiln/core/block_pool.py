"""`BlockPool`: every physical KV block, the LRU free list, and the prefix-cache hash table.

Freed blocks join the tail of the free list and allocation takes from the head, so a cached block
whose last user left stays findable by hash until it is the least recently freed one and is reused.
"""
from collections import OrderedDict
from collections.abc import Iterable

from kiln.core.kv_cache_utils import BlockHash, KVCacheBlock
from kiln.errors import ConfigError


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The cache key of a block of KV cache group `group`: each group holds its own layers' K/V
    for the same tokens. Group 0 keeps the plain hash; block hashes are fixed-length digests, so
    a suffix cannot make one group's key another's."""
    return block_hash if group == 0 else block_hash + b"#" + group.to_bytes(2, "little")


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got num_blocks={num_blocks}; "
                              "raise --kv-cache-memory or --num-gpu-blocks-override")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, oldest-freed first; OrderedDict gives O(1) removal from the middle,
        # needed when a prefix hit revives a free cached block.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be reused first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The block of KV cache group `group` (kv_cache_groups.py) cached under the hash."""
        return self._cached.get(group_key(block_hash, group)) if self.enable_caching else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free list, evicting their cached hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} KV blocks but only {len(self._free)} are free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the tail in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, group: int = 0) -> None:
        """Register a full block of KV cache group `group` under its hash so later requests with
        that prefix can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block_hash = group_key(block_hash, group)
        # Two requests may fill identical blocks concurrently; keep the first, the second block
        # simply stays unregistered and is recycled when its owner frees it.
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Make blocks unfindable by hash (their K/V is not what the hash promises)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use (returns success)."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
