"""Chained block hashing: parent-dependence, full blocks only, incremental == from scratch."""
from kiln.core.kv_cache_utils import (
    ROOT_BLOCK_HASH,
    hash_block_tokens,
    hash_token_blocks,
    update_block_hashes,
)

from .doubles import make_request


def test_hash_depends_on_parent_and_tokens():
    a = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert a != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5])
    # Same block tokens after a different prefix must not collide.
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(
        hash_block_tokens(ROOT_BLOCK_HASH, [4, 3, 2, 1]), [9, 9, 9, 9])
    # Token boundaries matter: [1, 23] vs [12, 3] style ambiguities do not exist.
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 23]) != hash_block_tokens(ROOT_BLOCK_HASH, [12, 3])


def test_chain_covers_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, 4)
    assert len(hashes) == 2  # 10 tokens -> 2 full blocks, the partial third is not hashed
    assert hashes[0] == hash_block_tokens(ROOT_BLOCK_HASH, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])


def test_update_block_hashes_is_incremental():
    req = make_request("r", list(range(6)))
    assert len(update_block_hashes(req, 4)) == 1
    req.output_token_ids.extend([100, 101])  # generated tokens complete the second block
    update_block_hashes(req, 4)
    assert req.block_hashes == hash_token_blocks(req.all_token_ids, 4)
    assert len(req.block_hashes) == 2
