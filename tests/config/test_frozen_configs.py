"""Configs are settings: once KilnConfig resolved them, assigning a field raises, a second
engine given them resolves its own copy, and what an engine learns at run time is its own."""
import dataclasses

import pytest
from transformers import LlamaConfig

from kiln.config import CacheConfig, CompilationConfig, KilnConfig, ModelConfig, SchedulerConfig
from kiln.config.frozen import ConfigFrozenError


def _model_config() -> ModelConfig:
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                     max_position_embeddings=128)
    return ModelConfig(model="unused", hf_config=hf, load_format="dummy")


def _config(**kw) -> KilnConfig:
    return KilnConfig(model_config=_model_config(),
                      scheduler_config=SchedulerConfig(max_num_seqs=4), **kw)


def test_sub_configs_resolve_then_refuse_assignment():
    sched = SchedulerConfig(max_num_seqs=4)
    sched.max_num_seqs = 2  # before resolution a config is a plain dataclass
    config = KilnConfig(model_config=_model_config(), scheduler_config=sched)
    assert sched.max_num_batched_tokens == 2048 and sched.max_model_len == 128  # resolved
    for owner, name, value in [(config, "enforce_eager", True),
                               (config.scheduler_config, "max_num_seqs", 8),
                               (config.cache_config, "block_size", 32),
                               (config.model_config, "max_model_len", 64),
                               (config.compilation_config, "mode", 0),
                               (config.compilation_config, "cudagraph_mode", "NONE"),
                               (config.device_config, "device", "cpu"),
                               (config.load_config, "load_format", "dummy"),
                               (config.parallel_config, "rank", 1)]:
        before = getattr(owner, name)
        with pytest.raises(ConfigFrozenError, match=rf"{type(owner).__name__}\.{name} cannot"):
            setattr(owner, name, value)
        assert getattr(owner, name) == before
    with pytest.raises(ConfigFrozenError, match="cannot be deleted"):
        del config.cache_config.block_size


def test_the_kv_block_count_is_no_setting():
    assert "num_blocks" not in {f.name for f in dataclasses.fields(CacheConfig)}


def test_the_attention_layer_table_is_no_setting():
    # layer name -> module is the model runner's (ModelRunner.attention_layers), not the config's
    assert "static_forward_context" not in {f.name for f in dataclasses.fields(CompilationConfig)}


def test_a_second_engine_resolves_its_own_copy():
    first = _config(compilation_config=CompilationConfig(mode=3))
    second = KilnConfig(model_config=first.model_config,
                        scheduler_config=first.scheduler_config,
                        compilation_config=first.compilation_config, enforce_eager=True)
    assert second.compilation_config is not first.compilation_config
    assert int(second.compilation_config.mode) == 0 and int(first.compilation_config.mode) == 3
    assert second.model_config is not first.model_config
    assert second.scheduler_config == first.scheduler_config and second.frozen


def test_replace_gives_a_config_to_resolve_again():
    config = _config()
    other = dataclasses.replace(config.cache_config, block_size=32)
    other.enable_prefix_caching = False  # a new config, not yet resolved
    assert not other.frozen and config.cache_config.block_size == 16
    assert _config(cache_config=other).cache_config.block_size == 32


def test_a_resolved_configs_lists_and_dicts_refuse_changes_in_place():
    """Assignment was refused, but compile_sizes.append(...) or pass_config[...] = ... changed
    a resolved config silently (its compile cache key with it), in every rank's copy at once."""
    import copy
    import json
    import pickle

    config = _config(compilation_config=CompilationConfig(
        mode=3, compile_sizes=[4], pass_config={"eliminate_noops": False}))
    key = config.compute_hash()
    cc = config.compilation_config
    for change, name in [(lambda: cc.compile_sizes.append(8), "CompilationConfig.compile_sizes"),
                         (lambda: cc.splitting_ops.clear(), "CompilationConfig.splitting_ops"),
                         (lambda: cc.pass_config.update(fuse_norm_quant=False),
                          "CompilationConfig.pass_config"),
                         (lambda: cc.inductor_compile_config.__setitem__("max_autotune", True),
                          "CompilationConfig.inductor_compile_config")]:
        with pytest.raises(ConfigFrozenError, match=rf"{name} cannot be changed in place"):
            change()
    assert cc.compile_sizes == [4] and config.compute_hash() == key
    # still lists and dicts to read, copy, send to a rank and write as JSON
    for same in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), config.for_rank(0)):
        assert same.compute_hash() == key and same.compilation_config.compile_sizes == [4]
        with pytest.raises(ConfigFrozenError):
            same.compilation_config.compile_sizes.append(8)
    assert json.loads(json.dumps(cc.pass_config)) == {"eliminate_noops": False}
    again = KilnConfig(model_config=config.model_config,
                       scheduler_config=config.scheduler_config, compilation_config=cc)
    assert again.compute_hash() == key


def test_a_replaced_config_has_its_own_lists_and_dicts():
    """dataclasses.replace(), which a frozen config's errors advise, gave a config that took
    assignment but refused inductor_compile_config[...] = ... (the resolved config's dict,
    shared); lists and dicts that resolution copies (compile_sizes, pass_config) were fine."""
    config = _config(compilation_config=CompilationConfig(
        mode=3, compile_sizes=[4], inductor_compile_config={"max_autotune": False}))
    cc = config.compilation_config
    other = dataclasses.replace(cc, mode=0)
    other.inductor_compile_config["max_autotune"] = True
    other.compile_sizes.append(8)
    assert cc.inductor_compile_config == {"max_autotune": False} and cc.compile_sizes == [4]
    built = CompilationConfig(inductor_compile_config=cc.inductor_compile_config)
    built.inductor_compile_config["max_autotune"] = True
    assert cc.inductor_compile_config == {"max_autotune": False}
    again = _config(compilation_config=other).compilation_config
    assert again.inductor_compile_config == {"max_autotune": True}
    assert again.compile_sizes == [4, 8] and again.frozen
