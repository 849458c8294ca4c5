"""Pure parts of the saved-graph warm start: which input sources are allowed, how the forward's
result maps to graph outputs, side-effect detection, gathering inputs from the forward's locals."""
import hashlib
import json

import pytest
import torch

from kiln.compilation.cache import CompileCache
from kiln.compilation.warm_start import graph_cache as gc


def test_safe_sources_are_lookup_chains_from_L():
    assert gc.is_safe_source("L['self']._modules['layers']._modules['0']._parameters['weight']")
    assert gc.is_safe_source("L['input_ids'].size()[0]")
    assert not gc.is_safe_source("__import__('os').system('x')")
    assert not gc.is_safe_source("L['x'].__class__.__init__(1)")
    assert not gc.is_safe_source("G['torch'].ones(3)")
    assert not gc.is_safe_source("L[")


def test_input_gatherer_reads_params_and_args_on_every_call():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fn = gc.InputGatherer(["L['self']._modules['0']._parameters['weight']", "L['x'].size()[0]",
                           "L['x']", "L['self']._modules['0']._parameters['bias']"])
    x = torch.ones(5, 2)
    w, n, same, b = fn({"self": model, "x": x})
    assert w is model[0].weight and n == 5 and same is x and b is model[0].bias
    model[0].weight = torch.nn.Parameter(torch.zeros(2, 2))  # replaced: the next call sees it
    assert fn({"self": model, "x": x})[0] is model[0].weight
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))  # another module: its own parameters
    assert fn({"self": other, "x": x})[0] is other[0].weight
    with pytest.raises(ValueError, match="not supported"):
        gc.InputGatherer(["open('f')"])


def test_parameter_sources_read_their_dict_directly():
    assert gc._leaf_container("L['self']._modules['a']._modules['0']._buffers['cos']") == (
        "L['self']._modules['a']._modules['0']._buffers", "cos")
    for other in ("L['x']", "L['x'].size()[0]", "L['x']._parameters['w']",
                  "L['self']._modules['a'].weight"):
        assert gc._leaf_container(other) is None


def test_output_spec_by_identity():
    a, b = torch.ones(1), torch.ones(1)
    assert gc.output_spec(b, (a, b)) == 1
    assert gc.output_spec((b, a), [a, b]) == [1, 0]
    assert gc.output_spec(torch.ones(1), (a, b)) is None  # equal values, other object
    assert gc.output_spec({"x": a}, (a,)) is None
    assert gc.output_spec(a, a) is None


def test_side_effects_detected_in_bytecode():
    def pure(self, x):
        y = x + 1
        return y

    def mutates(self, x):
        self.last = x
        return x

    assert not gc.has_side_effects(pure.__code__)
    assert gc.has_side_effects(mutates.__code__)


def test_runner_binds_args_kwargs_and_defaults():
    def forward(self, a, b=None, *, scale=2):
        return a

    seen = []

    def graph(*inputs):
        seen.append(inputs)
        return (inputs[0] * inputs[2], inputs[1])

    fn = gc.InputGatherer(["L['a']", "L['b']", "L['scale']"])
    runner = gc.SavedGraphRunner(graph, fn, 0, forward)
    assert runner(object(), 3) == 6 and seen[-1] == (3, None, 2)
    assert gc.SavedGraphRunner(graph, fn, [1, 0], forward)(object(), 3, b=4, scale=5) == (4, 15)
    with pytest.raises(ValueError, match=r"\*args"):
        gc.SavedGraphRunner(graph, fn, 0, lambda self, *a: a)


def test_input_meta_fits_symbolic_dims_only():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    traced = mode.from_tensor(torch.zeros(8, 4), symbolic_context=ctx)
    saved = [gc.input_meta(traced), gc.input_meta(traced.shape[0]), gc.input_meta(2)]
    assert saved == [["tensor", "torch.float32", [None, 4], [4, 1], "cpu"], "symint", 2]
    fits = [gc.input_meta(torch.zeros(3, 4)), 3, 2]
    assert gc.meta_mismatch(saved, fits) is None
    for bad in ([gc.input_meta(torch.zeros(3, 5)), 3, 2],  # weight of another shape
                [gc.input_meta(torch.zeros(3, 4, dtype=torch.float16)), 3, 2],
                [gc.input_meta(torch.zeros(4, 3).t()), 3, 2],  # other strides
                [gc.input_meta(torch.zeros(3, 4)), 3, 5],  # another constant
                [gc.input_meta(torch.zeros(3, 4)), torch.zeros(1), 2],
                [gc.input_meta(torch.zeros(3, 4)), 3]):
        assert gc.meta_mismatch(saved, bad) is not None, bad


def test_plan_round_trip_and_checksum(tmp_path):
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    import pickle
    plan = gc.SavedPlan(["L['x']"], 0, "sig", [{"submod": "submod_0", "graph_id": 0,
                                                 "fingerprint": "f", "size_arg": [0, 0]}],
                        [["tensor", "torch.float32", [None], [1], "cpu"]])
    cache = CompileCache(tmp_path, "rank_0", "backbone")
    gc.save_plan(cache, plan, pickle.dumps(gm))
    loaded, graph = gc.load_plan(cache)
    assert loaded == plan and torch.equal(graph(torch.tensor([-1.0, 2.0])), torch.tensor([0., 2.]))
    (cache.dir / gc.GRAPH_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="checksum"):
        gc.load_plan(cache)


def _save_slowly(key_dir: str, tag: bytes, plan_delay: float, start_delay: float) -> None:
    """A process saving its graph and plan, the plan's write delayed."""
    import time
    from pathlib import Path

    time.sleep(start_delay)
    write = gc.atomic_write_text

    def slow(path, text):
        time.sleep(plan_delay)
        write(path, text)

    gc.atomic_write_text = slow
    plan = gc.SavedPlan(sources=["L['x']"], output=0, signature="sig", pieces=[], input_meta=[])
    gc.save_plan(CompileCache(Path(key_dir), "rank_0", "backbone"), plan,
                 b"split graph of process " + tag)


def test_two_processes_saving_at_once_leave_a_plan_and_its_own_graph(tmp_path):
    """Two cold starts saving in the same second: A's graph, B's graph, B's plan, A's plan left
    A's plan naming B's graph, and the next start traced again (helper-25)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_save_slowly, args=(str(tmp_path), b"A", 1.0, 0.0)),
               ctx.Process(target=_save_slowly, args=(str(tmp_path), b"B", 0.0, 0.5))]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    directory = CompileCache(tmp_path, "rank_0", "backbone").dir
    plan = json.loads((directory / gc.PLAN_FILE).read_text())
    graph = (directory / gc.GRAPH_FILE).read_bytes()
    assert plan["graph_sha256"] == hashlib.sha256(graph).hexdigest(), graph
