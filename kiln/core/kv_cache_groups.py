"""KV cache groups of a hybrid sliding-window model (Gemma-2/3, Qwen2/3 with layer_types), as
vLLM's hybrid KV cache manager groups them: pure decisions the manager and the worker share.

Layers of one kind (full attention, or one window size) form groups of `num_slots` layers each;
every group has its own block table per request over one shared block pool, and the worker gives
slot j's layer of every group the same KV tensor, so a block id means one layer's block in any
group and a window group's blocks behind its window go back to the pool for the others' use.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kiln.core.sliding_window_blocks import blocks_held, kv_window, longest_window_hit, peak_blocks
from kiln.logger import init_logger

logger = init_logger(__name__)

Block = TypeVar("Block")


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention (every block kept)
    layers: tuple[int, ...]  # decoder layer indices; the i-th uses KV tensor slot i


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]
    num_slots: int  # KV tensors of num_blocks blocks each (one layer's block per id)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """Layer index -> (its group, its KV tensor slot)."""
        return {layer: (g, slot) for g, group in enumerate(self.groups)
                for slot, layer in enumerate(group.layers)}


def single_group(windows: Sequence[int | None]) -> KVCacheGroups:
    """Every layer in one group, each its own tensor: blocks are freed behind the window only
    when every layer has one (the widest), as before hybrid grouping."""
    return KVCacheGroups((KVCacheGroup(kv_window(windows), tuple(range(len(windows)))),),
                         len(windows))


def group_layers(windows: Sequence[int | None]) -> KVCacheGroups:
    """Groups of a model whose layer i has window `windows[i]` (None: full attention).

    One kind of layer (all full, or all windowed) keeps one group. Otherwise each kind's
    layers, in order, are cut into groups of as many layers as the smallest kind has (vLLM's
    choice where the counts differ: Gemma-3's 5 local : 1 global gives one full group and five
    window groups of the same size), the full group first; a kind's last group may be short,
    its missing slots' blocks unused."""
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        kinds.setdefault(window, []).append(i)
    if len(kinds) < 2 or None not in kinds:
        return single_group(windows)
    size = min(len(layers) for layers in kinds.values())
    order = [None] + sorted(k for k in kinds if k is not None)
    groups = tuple(KVCacheGroup(kind, tuple(kinds[kind][i:i + size]))
                   for kind in order for i in range(0, len(kinds[kind]), size))
    return KVCacheGroups(groups, size)


def _models(kiln_config) -> list:
    """The models whose layers take KV cache: the target's and, with a draft model or EAGLE
    head (the runner proposes), the draft's, its layers numbered after the target's."""
    models = [kiln_config.model_config]
    spec = getattr(kiln_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and getattr(spec, "runner_proposes", True):
        models.append(draft)
    return models


def all_layer_windows(kiln_config) -> list[int | None]:
    """Each KV cache layer's window, over every pipeline stage (each stage allocates its own
    layers' share of the groups, as vLLM groups every worker's layers together): the target's
    layers, then a draft model's or EAGLE head's (they join the groups of their kind, vLLM's
    choice for draft layers)."""
    return [m.layer_sliding_window(i) for m in _models(kiln_config) for i in range(m.num_layers)]


def hybrid_refusal(kiln_config) -> str | None:
    """Why an engine keeps one group for a hybrid model (every block kept), or None: it may
    group."""
    sched = getattr(kiln_config, "scheduler_config", None)
    if getattr(sched, "disable_hybrid_kv_cache_manager", False):
        return "--disable-hybrid-kv-cache-manager"
    # a slot's tensor serves one layer of each group: one layout (an MLA latent, one part per
    # token, is not K and V of the same head size)
    shapes = {(m.num_kv_heads, m.head_dim, getattr(m, "kv_cache_parts", 2))
              for m in _models(kiln_config)}
    if len(shapes) > 1:
        return (f"the draft model's K/V shape (kv heads, head size, parts: 2 K and V, 1 an MLA "
                f"latent) differs from the target's: {sorted(shapes)}")
    return None


def kv_cache_groups_of(kiln_config) -> KVCacheGroups:
    """The engine's KV cache groups over every layer (all_layer_windows), or one group (the
    widest window when every layer has one) where hybrid_refusal says so."""
    windows = all_layer_windows(kiln_config)
    reason = hybrid_refusal(kiln_config)
    groups = group_layers(windows) if reason is None else single_group(windows)
    if reason is not None and group_layers(windows).hybrid and not _told.get(reason):
        _told[reason] = True
        logger.info("KV cache groups: one group for every layer (every block kept): %s",
                    reason)
    return groups


_told: dict[str, bool] = {}  # fallback reasons logged in this process (once each)


def group_blocks_held(windows: Sequence[int | None], num_computed: int, num_slots: int,
                      block_size: int) -> int:
    """Real blocks a request holds across the groups (blocks_held summed)."""
    return sum(blocks_held(num_computed, num_slots, w, block_size) for w in windows)


def group_peak_blocks(windows: Sequence[int | None], num_tokens: int, chunk: int,
                      lookahead: int, block_size: int) -> int:
    """The most blocks a request of `num_tokens` holds at once across the groups: each group's
    peak (peak_blocks); every group's peak is reached at the request's end, so they add up."""
    return sum(peak_blocks(num_tokens, chunk, lookahead, w, block_size) for w in windows)


def max_fitting_tokens(windows: Sequence[int | None], num_blocks: int, chunk: int,
                       lookahead: int, block_size: int, limit: int) -> int:
    """The longest request (at most `limit` tokens) whose group_peak_blocks fit `num_blocks`:
    `limit` where every group is windowed and a request's need is bounded."""
    def fits(n: int) -> bool:
        return group_peak_blocks(windows, n, chunk, lookahead, block_size) <= num_blocks

    if fits(limit):
        return limit
    low, high = 0, limit  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def longest_full_hit(lookup: Callable[[int], Block | None], max_blocks: int) -> list[Block]:
    """The leading cached blocks (block i is `lookup(i)`, None: not cached), at most
    `max_blocks`."""
    hit = []
    for i in range(max_blocks):
        block = lookup(i)
        if block is None:
            break
        hit.append(block)
    return hit


def longest_group_hit(lookups: Sequence[Callable[[int], Block | None]],
                      windows: Sequence[int | None], max_blocks: int,
                      block_size: int) -> list[list[Block | None]]:
    """A prefix hit every group can serve (vLLM's HybridKVCacheCoordinator): one list per group,
    all as long as the shortest. A full group's hit cut shorter is still a hit; a window group's
    is not (the blocks before the new end must be cached), so the groups are asked again at the
    shorter length until none shortens it."""
    n = max_blocks
    while True:
        start, hits = n, []
        for lookup, window in zip(lookups, windows):
            hit = (longest_full_hit(lookup, n) if window is None
                   else longest_window_hit(lookup, n, window, block_size))
            hits.append(hit)
            n = min(n, len(hit))
        if n == start:
            return [hit[:n] for hit in hits]

