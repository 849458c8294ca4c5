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
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^compilation_config\.{field} must be"):
        CompilationConfig(**kwargs)


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
