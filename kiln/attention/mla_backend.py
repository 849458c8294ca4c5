"""Attention over a latent KV cache (DeepSeek's MLA, vLLM's layout): one cache row per token, the
normed latent c_kv (kv_lora_rank) then the roped k_pe, and no separate V: V is K's latent prefix.

The queries come weight-absorbed (kiln/model/layers/mla.py), so this is MQA of one KV head of
kv_lora_rank + rope dims whose output is kv_lora_rank wide. It is the torch backend's code over
that cache, on every platform: the C kernels (K and V of one head size) do not serve it.
"""

from kiln.attention.backend import AttentionImpl
from kiln.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    _gather_context,
    _valid_slots,
)
from kiln.errors import ConfigError


def latent_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, int, int, int, int]:
    """[1 (K only), num_blocks, block_size, 1, kv_lora_rank + rope]: the K/V layout's dims with
    no V, so the block tables, slots and sizing read it alike."""
    if num_kv_heads != 1:
        raise ConfigError(f"a latent KV cache has one head, got num_kv_heads={num_kv_heads}")
    return (1, num_blocks, block_size, 1, head_size)


class LatentAttentionImpl(TorchAttentionImpl):
    """q [T, nh*(L+R)] (absorbed queries), k [T, L+R] (c_kv, k_pe; v is ignored: a view of k's
    first L) -> out [T, nh*L], softmax(q k^T * scale) over the latent, L = v_head_size."""

    def __init__(self, num_heads: int, head_size: int, scale: float, v_head_size: int):
        super().__init__(num_heads, head_size, scale, 1)
        if not 0 < v_head_size <= head_size:
            raise ConfigError(f"kv_lora_rank ({v_head_size}) must be between 1 and the latent "
                              f"cache's head size ({head_size})")
        self.v_head_size = v_head_size

    def _heads(self, q, k, v, out) -> tuple:
        num_tokens, hd = q.shape[0], self.head_size
        k = k.view(num_tokens, 1, hd)
        return (q.view(num_tokens, self.num_heads, hd), k, k[..., :self.v_head_size],
                out.view(num_tokens, self.num_heads, self.v_head_size))

    def _write_kv(self, k, v, kv_cache, slot_mapping, step_cache) -> None:
        cache = kv_cache[0].view(-1, 1, self.head_size)  # [nb*bs, 1, L+R]
        slots, owners = _valid_slots(slot_mapping, k.shape[0], step_cache)
        if owners is not None:
            k = k.index_select(0, owners)
        cache.index_copy_(0, slots, k.to(cache.dtype))

    def _read_kv(self, kv_cache, blocks, num_keys: int, dtype) -> tuple:
        k = _gather_context(kv_cache[0], blocks, num_keys).to(dtype)  # [B, 1, S, L+R]
        return k, k[..., :self.v_head_size]


class LatentAttentionBackend(TorchAttentionBackend):
    name = "latent"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return LatentAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return latent_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
