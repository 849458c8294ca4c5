"""KV cache building blocks: the `KVCacheBlock` record and chained block hashing.

A full block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes (up to SHA-256 collisions), which is what makes a cached block safe to reuse.
"""
import hashlib
from array import array
from dataclasses import dataclass

from kiln.core.request import Request

BlockHash = bytes
# Parent of a request's first block; any fixed value works as long as it is the same everywhere.
ROOT_BLOCK_HASH: BlockHash = b""


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of the paged KV cache (the same id in every layer's cache tensor)."""
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache; None otherwise.
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def root_block_hash(cache_salt: str | None, lora_request=None) -> BlockHash:
    """Parent hash of a request's first block: a salt starts a chain no other salt shares, and
    so does a LoRA adapter (its K/V differ from the base model's and other adapters')."""
    if cache_salt is None and lora_request is None:
        return ROOT_BLOCK_HASH
    root = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    if lora_request is not None:
        # the salt's digest, fixed-length, so no salt's text can spell an adapter's key
        root = b"lora|" + hashlib.sha256(root).digest() + lora_request.hash_key()
    return hashlib.sha256(root).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids) -> BlockHash:
    """Hash of one full block: SHA-256 over the parent hash and the block's token ids."""
    # int64 bytes keep the encoding unambiguous (no separator tricks between token ids).
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def hash_token_blocks(token_ids: list[int], block_size: int,
                      parent_hash: BlockHash = ROOT_BLOCK_HASH) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens; returns the list.

    Tokens are only ever appended, so hashes already computed stay valid (also across preemption).
    """
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        start = len(hashes) * block_size
        tokens = request.all_token_ids[start:num_full * block_size]
        parent = hashes[-1] if hashes else root_block_hash(request.cache_salt, request.lora_request)
        hashes.extend(hash_token_blocks(tokens, block_size, parent))
    return hashes


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: blocks for a number of tokens."""
    return -(-a // b)
