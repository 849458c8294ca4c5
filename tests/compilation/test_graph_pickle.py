"""A pickled GraphModule comes back code-only: the same source runs, fx traces nothing."""
import pickle

import pytest
import torch
from torch import fx

from kiln.compilation.warm_start import graph_pickle
from kiln.compilation.warm_start.graph_pickle import CodeOnlyGraph


class _Inner(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.register_buffer("offset", torch.tensor([1.0, -1.0, 0.5]))

    def forward(self, x):
        return self.inner(x) + self.offset


def _split_like() -> fx.GraphModule:
    """A GraphModule with a GraphModule child and a get_attr constant, as a split graph has."""
    outer = fx.symbolic_trace(_Outer())
    outer.inner = fx.symbolic_trace(_Inner())
    outer.recompile()
    return outer


def test_code_only_round_trip_runs_the_same_without_tracing(monkeypatch):
    gm = _split_like()
    data = pickle.dumps(gm)
    traced = []
    real_trace = fx.Tracer.trace
    monkeypatch.setattr(fx.Tracer, "trace", lambda self, *a, **k: traced.append(1) or
                        real_trace(self, *a, **k))
    loaded = graph_pickle.loads(data)
    assert isinstance(loaded, CodeOnlyGraph) and isinstance(loaded.inner, CodeOnlyGraph)
    x = torch.tensor([[-2.0, 3.0, 0.25]])
    assert torch.equal(loaded(x), gm(x))
    assert traced == []
    pickle.loads(data)
    assert traced  # fx's own unpickler traces every module's source again


def test_a_failing_line_is_shown_in_the_traceback():
    loaded = graph_pickle.loads(pickle.dumps(_split_like()))
    with pytest.raises(RuntimeError) as err:
        loaded(torch.zeros(2, 4))  # the buffer does not broadcast
    entry = err.traceback[-1]
    assert "kiln saved graph" in str(entry.path) and "mul + offset" in str(entry.statement)
