"""KVCacheManager / BlockPool: allocation, free, LRU order, prefix hits, eviction."""
from kiln.core.block_pool import BlockPool
from kiln.core.kv_cache_manager import KVCacheManager

from .doubles import make_request

BS = 4


def admit(kv, req, num_new=None):
    """Admit a request the way the scheduler does; returns the prefix-hit token count."""
    blocks, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, blocks) is not None
    req.num_computed_tokens = num_hit + num_new
    return num_hit


def test_allocate_and_free_restore_free_count():
    kv = KVCacheManager(BS, 10)
    req = make_request("a", range(10))  # 10 tokens -> 3 blocks
    ids = kv.allocate_slots(req, 10)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert kv.num_free_blocks == 7 and abs(kv.usage() - 0.3) < 1e-9
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == []  # 11th token still fits in block 3
    req.num_computed_tokens = 12
    assert len(kv.allocate_slots(req, 1)) == 1  # 13th token needs a 4th block
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.usage() == 0.0
    assert kv.get_block_ids("a") == []


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(BS, 3)
    assert kv.allocate_slots(make_request("a", range(8)), 8) is not None
    before = kv.num_free_blocks
    assert kv.allocate_slots(make_request("b", range(100, 108)), 8) is None
    assert kv.num_free_blocks == before and kv.get_block_ids("b") == []


def test_free_list_is_lru_alloc_from_head_free_to_tail():
    pool = BlockPool(4, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert pool.free_block_ids() == [2, 3]
    pool.free_blocks([b, a])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, 1]


def test_prefix_hit_is_shared_and_counted():
    kv = KVCacheManager(BS, 20)
    prompt = list(range(50, 60))  # 10 tokens: 2 full blocks
    a = make_request("a", prompt)
    assert admit(kv, a) == 0
    b = make_request("b", prompt + [7, 8, 9])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert kv.prefix_cache_stats.queries == 10 + 13 and kv.prefix_cache_stats.hits == 8
    # Shared blocks are held twice: freeing one owner keeps them out of the free list.
    kv.free(a)
    assert kv.num_free_blocks == 20 - 4
    kv.free(b)
    assert kv.num_free_blocks == 20


def test_only_a_prompts_first_lookup_is_counted():
    """A preempted request's return found its own recomputed blocks and counted them as hits
    (its generated tokens as prompt tokens looked up); a prompt-logprobs request, which skips
    the cache, counted as a lookup that missed (helper-21)."""
    kv = KVCacheManager(BS, 20)
    a = make_request("a", range(50, 60))
    admit(kv, a)
    a.output_token_ids.extend([61, 62])
    kv.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1  # preempted: back to waiting
    assert admit(kv, a) == 8  # its own blocks still findable
    scoring = make_request("p", range(50, 60), prompt_logprobs=1)
    assert admit(kv, scoring) == 0
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (10, 0)


def test_hit_never_covers_the_last_token():
    kv = KVCacheManager(BS, 20)
    prompt = list(range(8))  # exactly 2 full blocks
    admit(kv, make_request("a", prompt))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 4 and len(blocks) == 1  # the second block is recomputed for the logits


def test_prefix_caching_off_gives_no_hits():
    kv = KVCacheManager(BS, 20, enable_caching=False)
    admit(kv, make_request("a", range(12)))
    assert kv.get_computed_blocks(make_request("b", range(12))) == ([], 0)


def test_freed_cached_blocks_stay_findable_until_reused():
    kv = KVCacheManager(BS, 4)
    prompt = list(range(9))  # 3 blocks, 2 full ones cached
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4  # cached blocks count as free ...
    c = make_request("c", prompt)
    assert admit(kv, c) == 8  # ... yet are still found and revived
    assert kv.num_free_blocks == 1
    kv.free(c)
    # Now a request with other tokens needs all 4 blocks: every cached hash is evicted.
    admit(kv, make_request("x", range(500, 516)))
    assert kv.block_pool.num_cached_blocks() == 4  # only x's own full blocks remain cached
    _, num_hit = kv.get_computed_blocks(make_request("d", prompt))
    assert num_hit == 0


def test_lru_eviction_prefers_least_recently_freed():
    kv = KVCacheManager(BS, 6)
    old, new = make_request("old", range(100, 105)), make_request("new", range(200, 205))
    admit(kv, old)
    admit(kv, new)
    kv.free(old)  # freed first -> evicted first
    kv.free(new)
    admit(kv, make_request("x", range(300, 304)), 4)  # takes 1 untouched block
    # Free list now: 5, old's tail block, old's cached block, new's tail, new's cached block.
    admit(kv, make_request("y", range(400, 412)), 12)  # takes 3: reaches old's cached block
    assert kv.get_computed_blocks(make_request("old2", range(100, 105)))[1] == 0
    assert kv.get_computed_blocks(make_request("new2", range(200, 205)))[1] == 4


def test_blocks_filled_by_generated_tokens_get_cached():
    kv = KVCacheManager(BS, 10)
    a = make_request("a", range(6))
    admit(kv, a)
    a.output_token_ids.extend([70, 71])  # decodes fill the second block
    for _ in range(2):
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    follow_up = make_request("b", list(range(6)) + [70, 71, 5])
    assert kv.get_computed_blocks(follow_up)[1] == 8


def test_eagle_prefix_hits_drop_their_last_block():
    """An EAGLE head's K/V at a block's last position read the token after it, which the hash
    does not cover: a hit leaves its last block to be computed again (vLLM's use_eagle), with
    and without a window (then the window's blocks before the new end stay cached)."""
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    for window in (None, 6, 1):
        kv = KVCacheManager(BS, 20, sliding_window=window, use_eagle=True)
        assert admit(kv, make_request("a", prompt)) == 0
        b = make_request("b", prompt[:12] + [7, 8])
        blocks, num_hit = kv.get_computed_blocks(b)
        assert num_hit == 8
        # a window of 1: the query after the hit reads its own key only
        assert blocks == ([None, None] if window == 1 else kv.req_to_blocks["a"][:2])
    plain = KVCacheManager(BS, 20)
    admit(plain, make_request("a", prompt))
    assert plain.get_computed_blocks(make_request("b", prompt[:12] + [7, 8]))[1] == 12
