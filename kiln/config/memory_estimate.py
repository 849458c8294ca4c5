"""The host memory an engine's size settings commit it to, estimated before anything is built,
so a size no machine could hold (--max-num-seqs 1000000000) is refused naming the flag instead
of failing deep in an allocation, or being killed by the kernel minutes later.

Rough on purpose: only what grows with the settings, each term an upper bound of its order.
"""
from kiln.errors import ConfigError

GiB = 1 << 30


def batch_table_bytes(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The runner's per-request rows: int32 token ids [max_num_seqs, max_model_len + 1] and
    block ids [max_num_seqs, blocks per request] (kiln/worker/input_batch.py)."""
    blocks = -(-max_model_len // block_size)
    return max_num_seqs * (max_model_len + 1 + blocks) * 4


def activation_bytes(max_num_batched_tokens: int, hidden: int, intermediate: int) -> int:
    """One step at its largest, in float32: a few [tokens, hidden] activations and the MLP's
    [tokens, 2 x intermediate] projection."""
    return 4 * max_num_batched_tokens * (8 * hidden + 3 * intermediate)


def logits_bytes(max_num_seqs: int, vocab: int) -> int:
    """The sampled rows' float32 logits [seqs, vocab] and the sampler's copies of them."""
    return 4 * 3 * max_num_seqs * vocab


def kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   elem_size: int, parts: int = 2) -> int:
    """One block across every layer: K and V (parts 2), or an MLA latent alone (parts 1)."""
    return parts * block_size * num_layers * num_kv_heads * head_dim * elem_size


def check_fits(needs: dict[str, int], total_bytes: int) -> None:
    """Refuse settings whose buffers alone exceed the machine's memory. `needs`: the settings
    that size a buffer (as flags, e.g. "--max-num-seqs 64 x --max-model-len 8192") -> bytes."""
    need = sum(needs.values())
    if need <= total_bytes:
        return
    biggest = max(needs, key=needs.get)
    raise ConfigError(f"{biggest} needs about {needs[biggest] / GiB:,.1f} GiB of memory (all "
                      f"buffers about {need / GiB:,.1f} GiB), more than this machine's "
                      f"{total_bytes / GiB:,.1f} GiB; lower those settings")
