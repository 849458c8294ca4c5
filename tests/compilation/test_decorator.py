"""Decorator and wrapper behaviour in every mode, on the eager compiler (no Inductor cost)."""

import pytest
import torch

from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.counters import compilation_counter
from kiln.compilation.decorator import ignore_torch_compile, infer_dynamic_arg_dims, support_torch_compile
from kiln.compilation.phase import RecompileAfterWarmupError
from kiln.compilation.warmup import compile_and_warm_up, sizes_to_run

import toy_model as tm


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")


def _check(model, reference, sizes):
    with torch.no_grad():
        for n in sizes:
            torch.testing.assert_close(model(*tm.inputs(n)), reference(*tm.inputs(n)))


def test_dynamic_dims_default_to_dim0_of_tensor_args():
    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None, scale: float,
                extra: "torch.Tensor | None" = None):
        pass
    assert infer_dynamic_arg_dims(forward) == {"ids": [0], "pos": [0], "extra": [0]}


def test_decorator_rejects_bad_dynamic_arg_dims():
    class NoTensors(torch.nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(ValueError, match="dynamic_arg_dims"):
        support_torch_compile(NoTensors)
    with pytest.raises(ValueError, match="nope"):
        support_torch_compile(dynamic_arg_dims={"nope": 0})(tm.ToyLayer)


def test_mode0_runs_eager_and_never_traces():
    with compilation_counter.expect(num_dynamo_traces=0, num_graphs_seen=0):
        model = tm.build(tm.toy_config(mode=0))
        _check(model, tm.build(tm.toy_config(mode=0)), [5, 1])
    assert model._kiln_compile is None


def test_ignore_torch_compile_and_enable_if():
    @ignore_torch_compile
    class Ignored(tm.ToyModel):
        pass
    @support_torch_compile(enable_if=lambda config: config.compilation_config.mode == 2)
    class Off(torch.nn.Module):
        def __init__(self, num_layers):
            super().__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1
    off = Off
    from kiln.config import set_current_kiln_config
    with set_current_kiln_config(tm.toy_config(mode=3, backend="eager")):
        assert not Ignored(num_layers=1)._kiln_compile_enabled
        assert not off(num_layers=1)._kiln_compile_enabled
        assert tm.ToyModel(num_layers=1)._kiln_compile_enabled


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_modes_match_eager_and_refuse_recompiles_after_warmup(mode):
    model = tm.build(tm.toy_config(mode=mode, backend="eager"))
    reference = tm.build(tm.toy_config(mode=0))
    _check(model, reference, [16, 1, 7])
    compile_state_of(model).warmup_phase.end()
    _check(model, reference, [2, 1, 9])  # new sizes: served without recompiling
    ids, positions = tm.inputs(4)
    with torch.no_grad(), pytest.raises(RecompileAfterWarmupError, match="int32|input_ids"):
        model(ids.int(), positions)


def test_each_engine_keeps_its_own_warmup_phase():
    """A second engine warming up in the same process neither relaxes the first one's
    no-recompile rule nor inherits it (mode 1: a dtype change is a Dynamo recompile)."""
    first_config = tm.toy_config(mode=1, backend="eager")
    first, reference = tm.build(first_config), tm.build(tm.toy_config(mode=0))
    with torch.no_grad():
        compile_and_warm_up(lambda n: first(*tm.inputs(n)), first_config,
                            compile_state_of(first).warmup_phase)
    second_config = tm.toy_config(mode=1, backend="eager")
    second = tm.build(second_config)
    assert compile_state_of(first).warmup_phase.serving
    assert not compile_state_of(second).warmup_phase.serving
    ids, positions = tm.inputs(4)
    with torch.no_grad():
        second(ids.int(), positions)  # still warming up: this recompile is allowed
        with pytest.raises(RecompileAfterWarmupError, match="recompile"):
            first(ids.int(), positions)
    _check(first, reference, [5, 1])

def test_mode1_accounts_its_trace_and_compile_time():
    """Mode 1 (stock torch.compile) reported "torch.compile took 0.00 s in all": its Dynamo
    frames and the backend's compile inside them were never timed (helper-90)."""
    from kiln.compilation import monitor

    config = tm.toy_config(mode=1, backend="eager")
    model, traced = tm.build(config), monitor.stats.trace_s
    with torch.no_grad():
        compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                            compile_state_of(model).warmup_phase)
    assert monitor.stats.trace_s > traced


def test_mode3_counts_pieces_and_shares_identical_layers():
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=7,
                                    num_piecewise_capturable_graphs_seen=4,
                                    num_backend_compilations=3, num_cache_hits=1):
        model = tm.build(tm.toy_config(mode=3, backend="eager", num_layers=3))
        _check(model, tm.build(tm.toy_config(mode=0, num_layers=3)), [8])


def test_no_dynamo_entry_after_first_call():
    from torch._dynamo.convert_frame import register_bytecode_hook

    model = tm.build(tm.toy_config(mode=3, backend="eager"))
    reference = tm.build(tm.toy_config(mode=0))
    _check(model, reference, [8])
    conversions = []
    handle = register_bytecode_hook(lambda code, new: conversions.append(code))
    try:
        torch._dynamo.reset()  # with Dynamo's caches gone, any entry into Dynamo would retrace
        with compilation_counter.expect(num_graphs_seen=0, num_dynamo_traces=0):
            _check(model, reference, [3, 1, 64])
    finally:
        handle.remove()
    assert conversions == []


def test_compile_size_beyond_budget_is_an_error():
    model = tm.build(tm.toy_config(mode=3, backend="eager", max_num_batched_tokens=16))
    _check(model, tm.build(tm.toy_config(mode=0)), [16])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        model(*tm.inputs(17))


def test_warmup_driver_runs_every_shape_then_ends_warmup():
    assert sizes_to_run(64, [1, 8, 128], compiled=True) == [8, 1]  # 128 is over the budget
    assert sizes_to_run(64, [1, 8], compiled=True, extra_sizes=[1, 16]) == [16, 8, 1]
    assert sizes_to_run(64, [1], compiled=True, extra_sizes=[1]) == [2, 1]  # never trace at 1
    assert sizes_to_run(1, [], compiled=True, extra_sizes=[1]) == [1]  # a 1-token budget
    assert sizes_to_run(64, [8], compiled=False, extra_sizes=[1, 16]) == [16, 1]  # eager
    config = tm.toy_config(mode=3, backend="eager", compile_sizes=[1, 8])
    model = tm.build(config)
    seen = []
    with torch.no_grad():
        compile_and_warm_up(lambda n: seen.append(model(*tm.inputs(n)).shape[0]), config,
                            compile_state_of(model).warmup_phase)
    assert seen == [8, 1] and compile_state_of(model).warmup_phase.serving
    pieces = model._kiln_compile.backend.pieces
    assert all(set(p.by_size) == {1, 8} for p in pieces.values())
    # Traced at 8 tokens, the range artifact serves the whole budget with nothing compiled.
    with compilation_counter.expect(num_backend_compilations=0, num_dynamo_traces=0):
        _check(model, tm.build(tm.toy_config(mode=0)), [64, 40, 2])


def test_eager_warm_start_runs_the_code_only_saved_graph(monkeypatch, tmp_path):
    # The eager compiler "compiles" a saved (code-only) piece by running it as it is.
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE")
    reference = tm.build(tm.toy_config(mode=0))
    for deltas in (dict(num_dynamo_traces=1, num_saved_graph_loads=0),
                   dict(num_dynamo_traces=0, num_saved_graph_loads=1)):
        config = tm.toy_config(mode=3, backend="eager", compile_sizes=[1, 8],
                               cache_dir=str(tmp_path))
        model = tm.build(config)
        with compilation_counter.expect(**deltas), torch.no_grad():
            compile_and_warm_up(lambda n, model=model: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
        _check(model, reference, [8, 3, 1])


@pytest.mark.parametrize("mode", [1, 2])
def test_stock_modes_pass_the_inductor_config_to_torch_compile(monkeypatch, mode):
    """Modes 1 and 2 dropped compilation_config.inductor_compile_config: torch.compile got only
    Kiln's schema pass, so a user's Inductor options never applied (vLLM passes them as
    torch.compile's options there) (helper-58)."""
    class Compiled(Exception):
        pass

    seen = []

    def fake_compile(fn, **kwargs):  # records the options; compiling is not this test's part
        seen.append(kwargs.get("options") or {})
        raise Compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tm.build(tm.toy_config(mode=mode, inductor_compile_config={"epilogue_fusion": False}))
    with torch.no_grad(), pytest.raises(Compiled):
        model(*tm.inputs(4))
    assert seen[-1]["epilogue_fusion"] is False
    assert "post_grad_custom_post_pass" in seen[-1]  # Kiln's op schemas still key the cache
