"""Which KV cache tensor each attention layer gets, and the bytes one block id costs: one tensor
per layer, or, in KV cache groups (kiln/core/kv_cache_groups.py), one per slot shared by the
slot's layer of every group, so a block id is one layer's block in whichever group holds it."""
from kiln.core.kv_cache_groups import KVCacheGroups
from kiln.errors import ConfigError
from kiln.worker import kv_cache_sizing


def layer_indices(layers: list, draft_layers: list = (), num_target: int = 0) -> list[int]:
    """`layers` then `draft_layers` (Attention modules) numbered as among the grouped layers
    (kv_cache_groups.all_layer_windows): each by its decoder layer (a pipeline stage's layers
    keep the whole model's numbers), a draft model's or EAGLE head's after the target's
    `num_target` layers."""
    from kiln.model.llama import layer_index

    return ([layer_index(layer.layer_name) for layer in layers]
            + [num_target + layer_index(layer.layer_name) for layer in draft_layers])


def layer_slots(layers: list, groups: KVCacheGroups,
                indices: list[int] | None = None) -> list[tuple[int, int]]:
    """(group, tensor slot) of each of `layers` (Attention modules: the model's, then a draft's)
    in order; `indices`: their numbers among the grouped layers (layer_indices). One group:
    each layer its own slot, as before grouping."""
    if not groups.hybrid:
        return [(0, i) for i in range(len(layers))]
    where = groups.layer_slots()
    slots = [where[i] for i in (layer_indices(layers) if indices is None else indices)]
    # one block of each layer's cache in its backend's layout (an MLA latent has no V part)
    shapes = {_block_shape(layer, 1) for layer in layers}
    if len(shapes) > 1:  # kv_cache_groups_of assumes the model config's one shape
        raise ConfigError(f"KV cache groups need one K/V shape in every layer, got {shapes}; "
                          "pass --disable-hybrid-kv-cache-manager")
    return slots


def block_bytes(layers: list, groups: KVCacheGroups, block_size: int, dtype,
                indices: list[int] | None = None) -> int:
    """Bytes a block id costs: one block of each tensor (each slot's first layer; a pipeline
    stage's slots only), in its backend's layout (K and V; an MLA latent alone)."""
    first: dict[int, object] = {}
    for layer, (_, slot) in zip(layers, layer_slots(layers, groups, indices)):
        first.setdefault(slot, layer)
    return kv_cache_sizing.bytes_per_block(
        [_block_shape(layer, block_size) for layer in first.values()], dtype)


def _block_shape(layer, block_size: int) -> tuple[int, ...]:
    return layer.backend.get_kv_cache_shape(1, block_size, layer.num_kv_heads, layer.head_size)


def assign_kv_caches(layers: list, groups: KVCacheGroups, new_tensor,
                     indices: list[int] | None = None) -> None:
    """Give each layer its tensor (`new_tensor(layer)` makes one of num_blocks blocks for a
    slot's first layer) and its group (`kv_group`: which block table its attention reads)."""
    tensors: dict[int, object] = {}
    for layer, (group, slot) in zip(layers, layer_slots(layers, groups, indices)):
        if slot not in tensors:
            tensors[slot] = new_tensor(layer)
        layer.kv_cache = tensors[slot]
        layer.kv_group = group
