"""CompilationConfig's validation: every bad value names its field, before anything compiles."""
import pytest

from kiln.config import CompilationConfig


@pytest.mark.parametrize("kwargs,field", [
    (dict(mode=7), "mode"), (dict(mode=True), "mode"), (dict(mode=3.7), "mode"),
    (dict(backend="tvm"), "backend"),
    (dict(compile_sizes=8), "compile_sizes"), (dict(compile_sizes=[0]), "compile_sizes"),
    (dict(compile_sizes=[True]), "compile_sizes"), (dict(compile_sizes=["8"]), "compile_sizes"),
    # a string would be split into its characters, splitting nothing
    (dict(splitting_ops="kiln::unified_attention"), "splitting_ops"),
    (dict(splitting_ops=["unified_attention"]), "splitting_ops"),
    (dict(inductor_compile_config={"no_such_option": 1}), "inductor_compile_config"),
    (dict(inductor_compile_config=[1]), "inductor_compile_config"),
    (dict(pass_config="fusion"), "pass_config"),
    (dict(cache_dir=5), "cache_dir"), (dict(debug_dump_path=5), "debug_dump_path"),
    # an option of the wrong type failed mid-compile, or ("yes") was taken as true
    (dict(inductor_compile_config={"cpp.threads": "x"}), r"inductor_compile_config\['cpp.threads'\]"),
    (dict(inductor_compile_config={"max_autotune": "yes"}), r"inductor_compile_config\['max_autotune'\]"),
    (dict(pass_config={"enable_fusion": "no"}), r"pass_config\.enable_fusion"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^compilation_config\.{field} must be"):
        CompilationConfig(**kwargs)


@pytest.mark.parametrize("pass_config, message", [
    # a misspelt pass left the pass on, and still changed the compile cache key
    ({"fuse_nrom_quant": False}, "unknown key 'fuse_nrom_quant'; Kiln's passes: eliminate_noops"),
    ({"enable_async_tp": True}, "enable_async_tp: Kiln has no such pass"),
    ({"enable_noop": False, "eliminate_noops": True},
     r"sets eliminate_noops both ways \(enable_noop is its older name\)"),
    # the message named the new key as the older one when the older came first
    ({"eliminate_noops": True, "enable_noop": False},
     r"sets eliminate_noops both ways \(enable_noop is its older name\)"),
])
def test_pass_config_keys_are_kilns_passes(pass_config, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig(pass_config=pass_config)


def test_pass_config_keeps_only_what_differs_from_the_defaults():
    """vLLM's older name maps onto Kiln's; its passes Kiln lacks may be set off; a pass set on
    (its default) is as if unset, so the compile cache key does not change."""
    given = {"enable_noop": False, "enable_async_tp": False, "fuse_norm_quant": True}
    assert CompilationConfig(pass_config=given).pass_config == {"eliminate_noops": False}
    assert given["enable_noop"] is False  # the caller's dict is not changed


def test_pass_names_are_the_passes():
    from kiln.compilation.passes.early_passes import LATE_PASSES, PASSES
    from kiln.config.compilation_config import PASS_NAMES

    assert set(PASS_NAMES) == {*PASSES, *LATE_PASSES, "enable_fusion"}


def test_good_values_normalise():
    cc = CompilationConfig(mode=3, compile_sizes=(8, 1, 8), splitting_ops=("kiln::x",),
                           inductor_compile_config={"cpp.threads": 2, "freezing": False})
    assert cc.compile_sizes == [1, 8] and cc.splitting_ops == ["kiln::x"]
    assert CompilationConfig.from_cli('{"mode": 0}').mode == 0


def test_splitting_op_missing_from_the_graph_warns(kiln_logs):
    import torch

    from kiln.compilation.split import split_graph

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    _, items = split_graph(gm, ["nope::op"])
    assert len(items) == 1 and "no op of compilation_config.splitting_ops" in kiln_logs.text


def test_cache_key_does_not_follow_the_checkpoints_path(tiny_llama_dir, tmp_path):
    """The same checkpoint moved (or copied) must find its compiled artifacts."""
    import shutil

    from kiln.config import KilnConfig, ModelConfig

    moved = tmp_path / "moved"
    shutil.copytree(tiny_llama_dir, moved)
    here, there = (KilnConfig(model_config=ModelConfig(model=str(p))) for p in
                   (tiny_llama_dir, moved))
    assert here.model_config.hf_config._name_or_path != there.model_config.hf_config._name_or_path
    assert here.compute_hash() == there.compute_hash()


def test_cache_key_follows_how_int8_weights_are_held(tiny_llama_dir, monkeypatch):
    """A graph calls the panel GEMM where int8 weights were packed at load, the GEMM over the
    weight as stored elsewhere: artifacts from a CPU of the one kind must not load on the other."""
    from kiln.config import KilnConfig, ModelConfig
    from kiln.native import int8_ops

    def key(quantization, panels):
        monkeypatch.setattr(int8_ops, "panel_cpu", lambda: panels)
        return KilnConfig(model_config=ModelConfig(model=str(tiny_llama_dir),
                                                   quantization=quantization)).compute_hash()

    assert key("int8", True) != key("int8", False)
    assert key(None, True) == key(None, False)


def test_a_bad_compile_cache_switch_is_refused_with_the_config(tiny_llama_dir, monkeypatch):
    """KILN_DISABLE_COMPILE_CACHE=maybe was first read in Dynamo's backend, after the model
    loaded: a BackendCompilerFailed traceback, where every other bad KILN_ variable is one line
    before anything loads (helper-58)."""
    from kiln.config import KilnConfig, ModelConfig

    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "maybe")
    with pytest.raises(ValueError, match="^KILN_DISABLE_COMPILE_CACHE='maybe' must be"):
        KilnConfig(model_config=ModelConfig(model=str(tiny_llama_dir)))


def test_vllms_deprecated_level_is_read_as_mode(kiln_logs):
    """vLLM still takes compilation_config={"level": N} (deprecated for mode, which wins when
    both are given): scripts written for older vLLM were refused with an unknown field."""
    from kiln.config.compilation_config import spec_to_dict

    assert CompilationConfig.from_cli({"level": 0}).mode == 0
    assert CompilationConfig.from_cli('{"level": 2}').mode == 2
    assert CompilationConfig.from_cli({"level": 0, "mode": 3}).mode == 3
    assert "deprecated name for mode" in kiln_logs.text
    with pytest.raises(ValueError, match=r"compilation_config\.level .* got 7"):
        CompilationConfig.from_cli({"level": 7})
    # a spec merged over another (kiln bench latency --compare) sets the mode its level names
    assert {**spec_to_dict(3), **spec_to_dict({"level": 0})} == {"mode": 0}
