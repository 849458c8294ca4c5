"""CUDAGraphWrapper on CPU: pass-through, the capture-phase rule, capture/replay bookkeeping.

torch.cuda.CUDAGraph and torch.cuda.graph are replaced by recording doubles, so the wrapper's
decisions run without a GPU; real capture and replay are covered by tests/gpu/.
"""
import contextlib
import gc
import logging
from types import SimpleNamespace

import pytest
import torch

from kiln.compilation.counters import compilation_counter
from kiln.config.compilation_config import CompilationConfig
from kiln.cudagraphs import wrapper as cudagraph_wrapper
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.cudagraphs.wrapper import (
    CUDAGraphWrapper,
    capture_phase,
    is_capture_phase_active,
    weak_ref_tensor,
    weak_ref_tensors,
    wrap_model_for_full_cudagraph,
    wrap_piece_for_cudagraph,
)
from kiln.forward_context import set_forward_context

M = CUDAGraphMode
CONFIG = SimpleNamespace(compilation_config=CompilationConfig())
ORIGINAL_GC_COLLECT = gc.collect


class FakeGraph:
    def __init__(self):
        self.replays = 0
        self.pool = None

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """Stand-ins for torch.cuda's graph API; records which pool each capture used."""
    graphs = []

    def make_graph():
        g = FakeGraph()
        graphs.append(g)
        return g

    @contextlib.contextmanager
    def graph_ctx(graph, pool=None, **kwargs):
        assert gc.collect is not ORIGINAL_GC_COLLECT  # collection is disabled while recording
        graph.pool = pool
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", make_graph)
    monkeypatch.setattr(torch.cuda, "graph", graph_ctx)
    monkeypatch.setattr(cudagraph_wrapper, "_global_graph_pool", "global-pool")
    return graphs


class Runnable:
    """Returns one persistent output tensor (a graph's outputs live in its pool)."""

    def __init__(self):
        self.calls = 0
        self.out = torch.zeros(4)
        self.attribute = "seen-through"

    def __call__(self, x):
        self.calls += 1
        self.out.copy_(x * 2)
        return self.out


def step(fn, x, mode, desc):
    with set_forward_context(None, CONFIG, layers={}, batch_descriptor=desc,
                             cudagraph_runtime_mode=mode):
        return fn(x)


def test_runtime_mode_must_be_piecewise_or_full():
    for bad in (M.NONE, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY):
        with pytest.raises(ValueError, match="PIECEWISE or FULL"):
            CUDAGraphWrapper(Runnable(), bad)


@pytest.mark.parametrize("wrapper_mode, step_mode", [
    (M.PIECEWISE, M.NONE), (M.PIECEWISE, M.FULL), (M.PIECEWISE, None),
    (M.FULL, M.NONE), (M.FULL, M.PIECEWISE)])
def test_pass_through_when_modes_differ(fake_cuda, wrapper_mode, step_mode):
    inner = Runnable()
    wrapper = CUDAGraphWrapper(inner, wrapper_mode)
    x = torch.arange(4.0)
    with compilation_counter.expect(num_cudagraph_captured=0, num_cudagraph_replays_full=0,
                                    num_cudagraph_replays_piecewise=0):
        for _ in range(3):
            assert torch.equal(step(wrapper, x, step_mode, BatchDescriptor(4)), x * 2)
        assert torch.equal(wrapper(x), x * 2)  # no forward context at all
    assert inner.calls == 4 and fake_cuda == [] and wrapper.captured_descriptors == []


def test_capture_outside_the_capture_phase_raises(fake_cuda):
    wrapper = CUDAGraphWrapper(Runnable(), M.PIECEWISE, name="piece_0")
    assert not is_capture_phase_active()
    with pytest.raises(RuntimeError, match="outside the capture phase.*piece_0|piece_0.*outside "
                                           "the capture phase"):
        step(wrapper, torch.ones(4), M.PIECEWISE, BatchDescriptor(4))
    assert fake_cuda == []


def test_capture_once_then_replay(fake_cuda):
    inner = Runnable()
    wrapper = CUDAGraphWrapper(inner, M.FULL)
    x = torch.arange(4.0)
    desc = BatchDescriptor(4, 4, True)
    with compilation_counter.expect(num_cudagraph_captured=1):
        with capture_phase():
            out = step(wrapper, x, M.FULL, desc)
    assert inner.calls == 1 and torch.equal(out, x * 2)
    assert fake_cuda[0].pool == "global-pool"  # the shared pool, fetched at capture
    with compilation_counter.expect(num_cudagraph_captured=0, num_cudagraph_replays_full=2,
                                    num_cudagraph_replays_piecewise=0):
        a = step(wrapper, x, M.FULL, desc)
        b = step(wrapper, x, M.FULL, desc)
    assert inner.calls == 1 and fake_cuda[0].replays == 2
    # Replays hand back the capture-time output memory (weakly held), not a new tensor.
    assert a.data_ptr() == b.data_ptr() == inner.out.data_ptr()
    # A descriptor never captured is not recorded during serving.
    with pytest.raises(RuntimeError, match="outside the capture phase"):
        step(wrapper, x, M.FULL, BatchDescriptor(8, 8, True))


def test_graphs_are_per_descriptor_and_use_the_given_pool(fake_cuda):
    inner = Runnable()
    wrapper = CUDAGraphWrapper(inner, M.PIECEWISE, graph_pool="my-pool")
    with capture_phase():
        for n in (4, 2, 1):
            step(wrapper, torch.ones(4), M.PIECEWISE, BatchDescriptor(n))
    assert [g.pool for g in fake_cuda] == ["my-pool"] * 3
    assert wrapper.captured_descriptors == [BatchDescriptor(4), BatchDescriptor(2),
                                            BatchDescriptor(1)]
    with compilation_counter.expect(num_cudagraph_replays_piecewise=1):
        step(wrapper, torch.ones(4), M.PIECEWISE, BatchDescriptor(2))
    assert [g.replays for g in fake_cuda] == [0, 1, 0]


def test_missing_descriptor_is_an_error(fake_cuda):
    wrapper = CUDAGraphWrapper(Runnable(), M.PIECEWISE)
    with pytest.raises(RuntimeError, match="batch_descriptor"):
        step(wrapper, torch.ones(4), M.PIECEWISE, None)


def test_debug_checks_input_addresses(fake_cuda):
    inner = Runnable()
    wrapper = CUDAGraphWrapper(inner, M.PIECEWISE, debug=True)
    buffer = torch.ones(8)  # the runner's persistent buffer
    desc = BatchDescriptor(4)
    with capture_phase():
        step(wrapper, buffer[:4], M.PIECEWISE, desc)
    step(wrapper, buffer[:4], M.PIECEWISE, desc)  # same address: fine
    with pytest.raises(RuntimeError, match=r"input\(s\) \[0\].*capture-time addresses"):
        step(wrapper, torch.ones(4), M.PIECEWISE, desc)


def test_debug_flag_from_environment(monkeypatch):
    monkeypatch.setenv("KILN_CUDAGRAPH_DEBUG", "1")
    assert CUDAGraphWrapper(Runnable(), M.FULL).debug is True
    monkeypatch.setenv("KILN_CUDAGRAPH_DEBUG", "0")
    assert CUDAGraphWrapper(Runnable(), M.FULL).debug is False
    assert CUDAGraphWrapper(Runnable(), M.FULL, debug=True).debug is True


def test_capture_phase_freezes_gc_and_logs(caplog):
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            with capture_phase(mem_get_info=lambda: (2**30, 2**31)):
                assert is_capture_phase_active()
                assert gc.get_freeze_count() > 0
                with pytest.raises(RuntimeError, match="nested"):
                    with capture_phase():
                        pass
    finally:
        logger.removeHandler(caplog.handler)
    assert not is_capture_phase_active()
    assert gc.get_freeze_count() == 0
    assert any(r.getMessage().startswith("Captured 0 CUDA graphs in") and "GiB" in r.getMessage()
               for r in caplog.records)


def test_capture_phase_ends_on_error():
    with pytest.raises(KeyError):
        with capture_phase():
            raise KeyError("boom")
    assert not is_capture_phase_active() and gc.get_freeze_count() == 0


def test_weak_ref_aliases_without_owning():
    base = torch.arange(6.0)
    use_count = lambda: torch._C._storage_Use_Count(base.untyped_storage()._cdata)  # noqa: E731
    before = use_count()
    alias = weak_ref_tensor(base[2:])
    assert use_count() == before  # a normal view would add one
    assert alias.data_ptr() == base[2:].data_ptr() and alias.shape == (4,)
    base[3] = 42.0
    assert alias[1] == 42.0
    pair = weak_ref_tensors((base, [base], 3))
    assert pair[0].data_ptr() == base.data_ptr() and isinstance(pair[1], list) and pair[2] == 3


def test_wrapper_behaves_like_the_wrapped_module():
    inner = Runnable()
    wrapper = CUDAGraphWrapper(inner, M.FULL)
    assert wrapper.attribute == "seen-through" and wrapper.unwrap() is inner
    with pytest.raises(AttributeError):
        _ = wrapper.no_such_attribute


@pytest.mark.parametrize("mode, piece_wrapped, model_wrapped", [
    (M.NONE, False, False), (M.PIECEWISE, True, False),
    (M.FULL, False, True), (M.FULL_DECODE_ONLY, False, True),
    (M.FULL_AND_PIECEWISE, True, True)])
def test_wrap_hooks_follow_the_resolved_mode(mode, piece_wrapped, model_wrapped):
    piece, model = Runnable(), torch.nn.Linear(2, 2)
    wrapped_piece = wrap_piece_for_cudagraph(piece, mode, is_last=True, name="piece_2")
    wrapped_model = wrap_model_for_full_cudagraph(model, mode)
    assert isinstance(wrapped_piece, CUDAGraphWrapper) == piece_wrapped
    assert isinstance(wrapped_model, CUDAGraphWrapper) == model_wrapped
    if piece_wrapped:
        assert wrapped_piece.runtime_mode is M.PIECEWISE and wrapped_piece.weak_ref_output
        assert wrapped_piece.name == "piece_2"
    if model_wrapped:
        assert wrapped_model.runtime_mode is M.FULL and wrapped_model.in_features == 2
