"""Compiled pieces are called without AOTAutograd's runtime wrapper only where it would just
stamp output hints: the same outputs, and the wrapper kept where it has work to do."""
import types

import torch
from torch import fx

from kiln.compilation.artifact_call import DirectCall, direct_callable, inner_compiled_graph


def _compile_and_load(tmp_path, fn, *inputs):
    """As Kiln serves a piece: compiled, saved, loaded back."""
    gm = fx.symbolic_trace(fn)
    artifact = torch._inductor.standalone_compile(gm, list(inputs),
                                                  dynamic_shapes="from_example_inputs")
    artifact.save(path=str(tmp_path / "a.bin"), format="binary")
    return torch._inductor.CompiledArtifact.load(path=str(tmp_path / "a.bin"), format="binary")


# torch 2.13 generates the runtime wrapper's code, which is what direct_callable recognises.
_GENERATED_WRAPPER = torch.__version__ >= (2, 13)


def _plain(x, w):
    return (torch.relu(x @ w) + 1.0,)


def test_plain_graph_is_called_directly_with_the_same_outputs(monkeypatch, tmp_path):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    artifact = _compile_and_load(tmp_path, _plain, x, w)
    with torch.inference_mode():
        expected = artifact(x, w)
    call = direct_callable(artifact)
    if not _GENERATED_WRAPPER:  # torch 2.11: a closure over runtime metadata, kept as it is
        assert call is artifact and torch.equal(call(x, w)[0], expected[0])
        return
    assert isinstance(call, DirectCall)
    through_artifact, generated_calls = [], []
    monkeypatch.setattr(call, "artifact",
                        lambda *a: through_artifact.append(1) or artifact(*a))
    generated = call.inner.current_callable
    monkeypatch.setattr(call.inner, "current_callable",
                        lambda args: generated_calls.append(1) or generated(args))
    with torch.inference_mode():
        first, second = call(x, w), call(x, w)  # the first goes through the artifact
    assert len(through_artifact) == 1 and len(generated_calls) == 2
    assert isinstance(second, list) and torch.equal(first[0], expected[0])
    assert torch.equal(second[0], expected[0])
    with torch.enable_grad():  # grad on: the artifact's call, which turns it off inside
        assert not call(x, w)[0].requires_grad
    with torch.inference_mode(), torch.profiler.profile() as prof:
        call(x, w)  # under the profiler: through the CompiledFxGraph, which labels the run
    assert any("CompiledFxGraph" in e.name for e in prof.events())


def _artifact_like(generated_globals: dict):
    """An object shaped like a loaded artifact, whose generated runtime wrapper has these
    globals (torch 2.13 names the work it does in them)."""
    namespace = {"torch": torch, "_mark_dynamic_": None, **generated_globals}
    defined = {}
    exec("def _runtime_wrapper(*args):\n    pass", namespace, defined)
    _codegen_runtime_wrapper = defined["_runtime_wrapper"]
    _inner_compiled_fn = types.SimpleNamespace(current_callable=lambda args: args)

    def runtime_wrapper(args):
        return _codegen_runtime_wrapper, _inner_compiled_fn

    compiled_fn = runtime_wrapper
    return types.SimpleNamespace(_compiled_fn=lambda *args: compiled_fn(list(args)))


def test_only_a_wrapper_that_just_stamps_hints_is_skipped():
    assert inner_compiled_graph(_artifact_like({"_dyn_dims_0": {0}})) is not None
    for work in ("_apply_mutations_", "_replay_aliases_", "_DisableAutocast_"):
        artifact = _artifact_like({work: object()})
        assert inner_compiled_graph(artifact) is None
        assert direct_callable(artifact) is artifact
    plain_function = lambda *a: a  # noqa: E731  (not an artifact at all)
    assert direct_callable(plain_function) is plain_function
