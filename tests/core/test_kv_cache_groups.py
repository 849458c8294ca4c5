"""KV cache groups of hybrid sliding-window models (kiln/core/kv_cache_groups.py): the grouping,
a hit every group serves against brute force, each group's need, the longest request that fits,
the KV cache manager keeping a table per group, and the worker's tensor per slot."""
import itertools
import logging
import random
from types import SimpleNamespace

import pytest
import torch

from kiln.attention.backend import AttentionBackend
from kiln.core.block_pool import BlockPool
from kiln.core.kv_cache_groups import (
    group_layers,
    group_peak_blocks,
    kv_cache_groups_of,
    longest_group_hit,
    max_fitting_tokens,
)
from kiln.core.kv_cache_manager import KVCacheManager
from kiln.core.kv_cache_utils import cdiv
from kiln.core.sliding_window_blocks import peak_blocks, window_hit_blocks
from kiln.errors import ConfigError
from kiln.worker import kv_cache_layout

from .doubles import make_request


def test_grouping_follows_vllm():
    gemma2 = group_layers([8, None] * 3)  # alternating: one full group, one window group
    assert [(g.window, g.layers) for g in gemma2.groups] == [(None, (1, 3, 5)), (8, (0, 2, 4))]
    assert gemma2.num_slots == 3 and gemma2.layer_slots()[4] == (1, 2)
    # Gemma-3 1B: 26 layers, every 6th global: groups of the 4 global layers' size
    gemma3 = group_layers([None if i % 6 == 5 else 512 for i in range(26)])
    assert gemma3.num_slots == 4 and gemma3.windows == (None,) + (512,) * 6
    assert gemma3.groups[0].layers == (5, 11, 17, 23) and gemma3.groups[-1].layers == (24, 25)
    assert sorted(gemma3.layer_slots()) == list(range(26))
    # one kind of layer: one group, each layer its own tensor (as before grouping)
    for windows, window in (([8, 8], 8), ([4, 8], 8), ([None, None], None)):
        single = group_layers(windows)
        assert single.windows == (window,) and single.num_slots == 2 and not single.hybrid
    mixed = group_layers([4, None, 8, None])  # two window sizes: a group each
    assert mixed.windows == (None, None, 4, 8) and mixed.num_slots == 1


def _model(windows, kv_heads=2, head_dim=16):
    return SimpleNamespace(num_layers=len(windows), layer_sliding_window=windows.__getitem__,
                           num_kv_heads=kv_heads, head_dim=head_dim)


def _config(windows, **extra):
    return SimpleNamespace(model_config=_model(windows), scheduler_config=SimpleNamespace(**extra),
                           speculative_config=None,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1))


def test_draft_layers_join_the_groups_and_refusals_keep_one(caplog):
    assert kv_cache_groups_of(_config([8, None])).windows == (None, 8)
    flag = _config([8, None], disable_hybrid_kv_cache_manager=True)
    assert kv_cache_groups_of(flag).windows == (None,)  # every block kept, as before
    ngram = _config([8, None])
    ngram.speculative_config = SimpleNamespace(method="ngram", runner_proposes=False,
                                               draft_model_config=None)
    assert kv_cache_groups_of(ngram).hybrid  # no model reads the block tables
    # a draft model's layers (numbered after the target's) join the groups of their kind
    draft = _config([8, None])
    draft.speculative_config = SimpleNamespace(method="draft_model", runner_proposes=True,
                                               draft_model_config=_model([8, None]))
    groups = kv_cache_groups_of(draft)
    assert [(g.window, g.layers) for g in groups.groups] == [(None, (1, 3)), (8, (0, 2))]
    # an EAGLE head's full-attention layer joins the full group
    eagle = _config([8, 8, None])
    eagle.speculative_config = SimpleNamespace(method="eagle", runner_proposes=True,
                                               draft_model_config=_model([None]))
    assert [(g.window, g.layers) for g in kv_cache_groups_of(eagle).groups] == [
        (None, (2, 3)), (8, (0, 1))]
    # K/V of another shape cannot share a slot's tensor: one group, said at INFO
    other = _config([8, None])
    other.speculative_config = SimpleNamespace(method="draft_model", runner_proposes=True,
                                               draft_model_config=_model([8], kv_heads=1))
    with caplog.at_level(logging.INFO, logger="kiln.core.kv_cache_groups"):
        assert kv_cache_groups_of(other).windows == (None,)
    assert "K/V shape" in caplog.text and "one group" in caplog.text
    # an MLA draft of the target's (kv heads, head size) still has another layout: its layer's
    # slot tensor [1, ...] held no V for the target's layer sharing it (IndexError in a step)
    latent = _config([8, None])
    latent.speculative_config = SimpleNamespace(
        method="draft_model", runner_proposes=True,
        draft_model_config=SimpleNamespace(**vars(_model([None])), kv_cache_parts=1))
    assert kv_cache_groups_of(latent).windows == (None,)


def _valid(cached: set[int], n: int, window: int | None, bs: int) -> bool:
    """Brute force: a hit of n blocks is usable by a group when every block a query after it
    reads is cached (full: all n; window: the last window_hit_blocks, or all from block 0)."""
    if window is None:
        return all(i in cached for i in range(n))
    need = window_hit_blocks(window, bs)
    return all(i in cached for i in range(max(0, n - need), n))


def test_group_hit_is_the_longest_every_group_serves():
    rng = random.Random(0)
    for _ in range(400):
        bs = rng.choice((1, 2, 4))
        windows = rng.choice(((None, 8), (None, 5, 5), (None, 3, 9), (None,)))
        max_blocks = rng.randrange(0, 14)
        cached = [{i for i in range(max_blocks) if rng.random() < 0.8} for _ in windows]
        lookups = [lambda i, c=c: ("b", i) if i in c else None for c in cached]
        hits = longest_group_hit(lookups, windows, max_blocks, bs)
        want = max(n for n in range(max_blocks + 1)
                   if all(_valid(c, n, w, bs) for c, w in zip(cached, windows)))
        assert [len(h) for h in hits] == [want] * len(windows), (windows, cached, bs)
        for hit, c in zip(hits, cached):  # what a hit holds is cached
            assert all(b is None or b[1] in c for b in hit)


def test_need_adds_each_groups_peak_and_fitting_is_its_inverse():
    assert group_peak_blocks((None, 8), 100, 16, 0, 4) == 25 + peak_blocks(100, 16, 0, 8, 4)
    for windows, blocks, bs in itertools.product(((None,), (None, 8), (None, 8, 8), (8,)),
                                                 (3, 10, 40), (1, 4)):
        fit = max_fitting_tokens(windows, blocks, 16, 0, bs, 500)
        want = max([n for n in range(501)
                    if group_peak_blocks(windows, n, 16, 0, bs) <= blocks])
        assert fit == want
    assert max_fitting_tokens((8,), 10, 16, 0, 4, 500) == 500  # bounded: any length


def test_manager_keeps_a_table_per_group_and_frees_behind_the_window():
    bs, window = 4, 8
    kv = KVCacheManager(bs, 40, group_windows=(None, window))
    req = make_request("a", range(100, 160))  # 60 tokens, 15 blocks
    computed = 0
    while computed < 60:  # chunks of 6: the window group holds its last few blocks only
        assert kv.allocate_slots(req, 6) is not None
        computed += 6
        req.num_computed_tokens = computed
        full, windowed = kv.req_to_group_blocks["a"]
        assert len(full) == len(windowed) == cdiv(computed, bs) and None not in full
        assert sum(b is not None for b in windowed) <= peak_blocks(60, 6, 0, window, bs)
    assert kv.get_block_ids("a") != kv.get_block_ids("a", 1)
    assert kv.other_group_block_ids("a", last=2) == [kv.get_block_ids("a", 1)[-2:]]
    # a longer prompt with the same prefix hits both groups' blocks
    hit, num_hit = kv.get_computed_blocks(make_request("b", list(range(100, 160)) + [1, 2]))
    assert num_hit == 60 and [len(h) for h in hit] == [15, 15]
    assert hit[0] == kv.req_to_group_blocks["a"][0]
    assert hit[1][-2:] == kv.req_to_group_blocks["a"][1][-2:]  # the window's last blocks
    kv.free(req)
    assert kv.num_free_blocks == 40 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_group_blocks_are_cached_apart():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h" * 32, group=0)
    pool.cache_block(b, b"h" * 32, group=1)
    assert pool.get_cached_block(b"h" * 32) is a and pool.get_cached_block(b"h" * 32, 1) is b
    assert pool.get_cached_block(b"h" * 32, 2) is None


def test_draft_and_stage_layers_find_their_slots():
    """A draft's layers (named as the target's) are numbered after the target's; a pipeline
    stage's layers keep their model numbers, so a stage allocates only its own slots."""
    def named(*indices):
        return [SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", num_kv_heads=2,
                                head_size=16, backend=AttentionBackend) for i in indices]

    target, draft = named(0, 1), named(0, 1)
    assert kv_cache_layout.layer_indices(target, draft, 2) == [0, 1, 2, 3]
    groups = group_layers([8, None, 8, None])
    layers, indices = target + draft, kv_cache_layout.layer_indices(target, draft, 2)
    kv_cache_layout.assign_kv_caches(layers, groups, lambda layer: torch.zeros(1), indices)
    assert [layer.kv_group for layer in layers] == [1, 0, 1, 0]
    assert layers[2].kv_cache is layers[3].kv_cache is not layers[0].kv_cache
    stage = named(2, 3)  # the second stage of a 4-layer model: slot 1 only
    assert kv_cache_layout.layer_slots(stage, groups) == [(1, 1), (0, 1)]
    assert (kv_cache_layout.block_bytes(stage, groups, 4, torch.float32)
            == kv_cache_layout.block_bytes(named(0), group_layers([None]), 4, torch.float32))


def test_a_latent_and_a_kv_layer_never_share_a_slot():
    """Equal (kv heads, head size) but the latent backend's cache has no V part."""
    from kiln.attention.mla_backend import LatentAttentionBackend

    layers = [SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", num_kv_heads=1,
                              head_size=40, backend=backend)
              for i, backend in enumerate((AttentionBackend, LatentAttentionBackend))]
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        kv_cache_layout.layer_slots(layers, group_layers([8, None]))


def test_worker_shares_a_tensor_per_slot():
    layers = [SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", num_kv_heads=2,
                              head_size=16, backend=AttentionBackend) for i in range(4)]
    groups = group_layers([8, None, 8, None])
    single = group_layers([None] * 4)
    # a block id costs one layer per slot: half of every layer's
    assert (kv_cache_layout.block_bytes(layers, groups, 4, torch.float32) * 2
            == kv_cache_layout.block_bytes(layers, single, 4, torch.float32))
    kv_cache_layout.assign_kv_caches(layers, groups, lambda layer: torch.zeros(1))
    assert [layer.kv_group for layer in layers] == [1, 0, 1, 0]
    assert layers[0].kv_cache is layers[1].kv_cache and layers[2].kv_cache is layers[3].kv_cache
    assert layers[0].kv_cache is not layers[2].kv_cache


def test_refusal_counts_every_groups_blocks():
    """A cache too small for one max_model_len request in groups is refused naming what the
    groups need: it said 25 KiB were needed, 'larger than' the 30 KiB there were (one block per
    4 tokens, as one full-attention table needs)."""
    from kiln.core.engine_core import EngineCore

    config = _config([8] * 5 + [None], max_num_batched_tokens=16)  # Gemma-3's six groups
    config.model_config.max_model_len, config.model_config.max_model_len_from_model = 100, False
    config.cache_config = SimpleNamespace(block_size=4, num_gpu_blocks_override=30)
    core = SimpleNamespace(kiln_config=config,
                           executor=SimpleNamespace(kv_cache_block_bytes=lambda: 1024))
    with pytest.raises(ConfigError, match=r"\(60.00 KiB KV cache is needed, which is larger "
                       r"than the available KV cache memory \(30.00 KiB\).*maximum model "
                       r"length is 20\."):
        EngineCore._fit_max_model_len(core, 30)
