"""Which KV blocks a windowed request still needs (kiln/core/sliding_window_blocks.py), against
brute force over the keys each query reads, and the KV cache manager freeing them."""
import itertools
import random
from types import SimpleNamespace

from kiln.attention.masking import first_key
from kiln.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from kiln.core.kv_cache_utils import cdiv
from kiln.core.sliding_window_blocks import (
    blocks_held,
    kv_window,
    kv_window_of,
    longest_window_hit,
    num_skipped_blocks,
    peak_blocks,
    prompt_tokens_cached,
    window_hit_blocks,
)

from .doubles import make_request


def test_kv_window_needs_every_layer_windowed():
    assert kv_window([8, 8]) == 8
    assert kv_window([4, 8]) == 8  # the widest window bounds what any layer reads
    assert kv_window([8, None]) is None  # hybrid (Gemma-2/3): its global layers read every block
    assert kv_window([None, None]) is None and kv_window([]) is None


def test_kv_window_of_a_config():
    from kiln.config import ModelConfig

    from .doubles import make_config

    assert kv_window_of(make_config(window=8)) == 8  # a Mistral windowed in every layer
    assert kv_window_of(make_config()) is None  # a Llama
    # the front end's bound on a prompt: the whole cache, or none past max_model_len under a window
    full = make_config()
    assert prompt_tokens_cached(full, 10) == 10 * full.cache_config.block_size
    assert prompt_tokens_cached(make_config(window=8), 10) is None
    hf = make_config(window=8).model_config.hf_config
    full = ModelConfig(model="unused", hf_config=hf, load_format="dummy", max_model_len=8,
                       disable_sliding_window=True)
    # every layer attends fully under the flag
    assert kv_window_of(SimpleNamespace(model_config=full)) is None


def test_skipped_blocks_are_those_no_later_query_reads():
    for window, bs, c in itertools.product(range(1, 20), (1, 2, 4, 16), range(0, 70)):
        skipped = num_skipped_blocks(c, window, bs)
        read = {k // bs for q in range(c, c + 40) for k in range(first_key(q, window), q + 1)}
        assert all(b not in read for b in range(skipped))  # freeable
        assert skipped == min(read)  # and nothing more is kept
    assert num_skipped_blocks(40, 16, 16) == 1  # keys 25..40 from block 1 on
    assert num_skipped_blocks(47, 16, 16) == 2


def test_peak_blocks_bounds_every_step():
    """Chunks of `chunk` tokens then one-token decodes: the blocks held at each step never exceed
    peak_blocks, which is reached (tight) once the request runs past the window."""
    for window, bs, chunk, la in itertools.product((1, 5, 16, 33), (1, 4, 16), (1, 7, 64),
                                                   (0, 3)):
        bound = peak_blocks(10**6, chunk, la, window, bs)
        held = []
        c = 0
        while c < 400:
            n = chunk if c < 200 else 1
            held.append(blocks_held(c, c + n + la, window, bs))
            c += n
        assert max(held) <= bound, (window, bs, chunk, la)
        # a decode holds at most ceil(window / block) + 1 blocks plus the lookahead's
        assert max(held[-100:]) <= cdiv(window, bs) + 1 + cdiv(la, bs)
    assert peak_blocks(10**6, 1, 0, 16, 16) == 2
    assert peak_blocks(20, 512, 0, 16, 16) == 2  # a short request: its own blocks
    assert peak_blocks(1000, 64, 0, None, 16) == 63  # full attention: every block


def _brute_hit(cached: list[bool], window: int, bs: int) -> int:
    """Longest n: every block the window of the query at n * bs reads is cached."""
    best = 0
    for n in range(len(cached) + 1):
        if all(cached[num_skipped_blocks(n * bs, window, bs):n]):
            best = n
    return best


def test_longest_window_hit_against_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        window, bs = rng.randrange(1, 30), rng.choice((1, 2, 4, 8))
        cached = [rng.random() < 0.7 for _ in range(rng.randrange(0, 14))]
        blocks = [f"b{i}" if c else None for i, c in enumerate(cached)]
        hit = longest_window_hit(blocks.__getitem__, len(blocks), window, bs)
        n = len(hit)
        assert n == _brute_hit(cached, window, bs), (window, bs, cached)
        first = num_skipped_blocks(n * bs, window, bs)
        assert hit[first:] == blocks[first:n]  # what the window reads is the cached blocks
        assert all(b is None or b == blocks[i] for i, b in enumerate(hit))
    assert window_hit_blocks(16, 16) == 1 and window_hit_blocks(17, 16) == 1
    assert window_hit_blocks(18, 16) == 2 and window_hit_blocks(1, 16) == 0


def _decode(kv, request, steps):
    """A prefilled request samples a token, then decodes `steps` more, one a step."""
    for _ in range(steps):
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def test_manager_frees_blocks_behind_the_window_and_hits_their_tail():
    bs, window = 4, 8
    kv = KVCacheManager(bs, 12, sliding_window=window)
    prompt = list(range(10, 30))  # 20 tokens: 5 blocks
    a = make_request("a", prompt, max_tokens=100)
    assert kv.allocate_slots(a, 20) is not None
    a.num_computed_tokens = 20
    assert kv.num_free_blocks == 7
    _decode(kv, a, 30)  # to 50 tokens: a decode at 49 reads keys 42.. (blocks 10, 11, 12)
    ids = kv.get_block_ids("a")
    assert len(ids) == 13 and ids[:10] == [NULL_BLOCK_ID] * 10  # positions keep their slots
    assert sum(b is not None for b in kv.req_to_blocks["a"]) <= 3
    assert kv.num_free_blocks >= 9  # 13 blocks' worth of tokens in 3
    # the prompt's blocks went back to the pool with their hashes: a prompt sharing its first
    # 20 tokens hits them, needing only the 2 blocks its next query's window reads
    b = make_request("b", prompt + [99], max_tokens=4)
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20 and hit[:3] == [None] * 3 and None not in hit[3:]
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.get_block_ids("b")[:3] == [NULL_BLOCK_ID] * 3
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 12 and all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)


def test_full_attention_manager_keeps_every_block():
    kv = KVCacheManager(4, 20)
    a = make_request("a", list(range(10, 30)), max_tokens=100)
    assert kv.allocate_slots(a, 20) is not None
    a.num_computed_tokens = 20
    _decode(kv, a, 30)
    assert None not in kv.req_to_blocks["a"] and kv.num_free_blocks == 20 - 13
