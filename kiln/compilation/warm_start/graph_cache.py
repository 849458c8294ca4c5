"""Warm starts without Dynamo: what a cold trace saves so a later process can skip tracing.

Saved per cache key: the split graph (pickled), the source of each graph input as Dynamo names it
(`L['self']._modules[...]._parameters['weight']`, `L['input_ids'].size()[0]`), the compiled
pieces' fingerprints and how the forward's result is made of the graph's outputs.
"""
import ast
import contextlib
import dis
import hashlib
import inspect
import json
import os
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.atomic_write import atomic_write_text
from kiln.compilation.cache import CompileCache
from kiln.compilation.warm_start import graph_pickle
from kiln.compilation.warm_start.graph_pickle import CodeOnlyGraph

FORMAT_VERSION = 2  # 2: the plan carries its own checksum
PLAN_FILE = "saved_graph.json"
GRAPH_FILE = "saved_graph.pkl"

# Bytecode that changes state outside the graph (Dynamo replays such side effects after the
# graph call); a saved graph alone would drop them, so such a trace is not saved.
_SIDE_EFFECT_OPS = {"STORE_ATTR", "STORE_GLOBAL", "STORE_SUBSCR", "STORE_DEREF", "DELETE_ATTR",
                    "DELETE_GLOBAL", "DELETE_SUBSCR", "DELETE_DEREF"}
_SOURCE_METHODS = {"size", "stride", "storage_offset"}


@dataclass
class SavedPlan:
    sources: list[str]  # one Python expression over `L` (the forward's locals) per graph input
    output: list[int] | int  # int: the forward returns graph output i; list: a tuple of them
    signature: str  # repr of the wrapper's (dtype, ndim, device) signature of the inputs
    pieces: list[dict]  # {"submod", "graph_id", "fingerprint", "size_arg"} per compiled piece
    input_meta: list  # input_meta() of every graph input as traced (symbolic dims as None)
    format: int = FORMAT_VERSION


def source_name(source: Any) -> str:
    """A Dynamo Source as a Python expression (`name` is a property in 2.13, a method before)."""
    name = source.name
    return name() if callable(name) else name


def graph_inputs(gm: fx.GraphModule) -> tuple[list[str], list] | None:
    """The source and input_meta() of every placeholder of a Dynamo graph, in order; None if
    one lacks them."""
    sources, metas = [], []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        if source is None or "example_value" not in node.meta:
            return None
        sources.append(source_name(source))
        metas.append(input_meta(node.meta["example_value"]))
    return sources, metas


def input_meta(x: Any) -> list | str | int | float | None:
    """What the traced graph assumed about one input: a tensor's dtype, shape, strides and
    device (symbolic entries None), a SymInt's kind, or a constant's value. JSON-able."""
    def concrete(values):
        return [v if isinstance(v, int) else None for v in values]
    if isinstance(x, torch.Tensor):
        return ["tensor", str(x.dtype), concrete(x.shape), concrete(x.stride()), x.device.type]
    if isinstance(x, torch.SymInt):
        return "symint"
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<{type(x).__name__}>"


def meta_mismatch(saved: list, actual: list) -> str | None:
    """The first input whose actual metadata does not fit what was traced, or None."""
    if len(saved) != len(actual):
        return f"{len(actual)} graph inputs, traced with {len(saved)}"
    for i, (want, got) in enumerate(zip(saved, actual)):
        if want == "symint" and isinstance(got, int):
            continue
        if isinstance(want, list) and isinstance(got, list) and want[:2] == got[:2] and (
                want[4] == got[4] and len(want[2]) == len(got[2]) and len(want[3]) == len(got[3])
                and all(w is None or w == g for w, g in zip(want[2] + want[3], got[2] + got[3]))):
            continue
        if want != got or want == "symint":
            return f"graph input {i} is {got}, traced as {want}"
    return None


def is_safe_source(expr: str) -> bool:
    """Only attribute/constant-subscript chains from `L` and size()/stride() calls: a saved
    plan is data, and evaluating it must not run anything else."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return False

    def ok(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "L"
        if isinstance(node, ast.Attribute):
            return ok(node.value)
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and ok(node.value)
        if isinstance(node, ast.Call):
            return (not node.args and not node.keywords and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _SOURCE_METHODS and ok(node.func.value))
        return False

    return ok(tree.body)


def _leaf_container(source: str) -> tuple[str, str] | None:
    """(the dict expression, the key) of a parameter or buffer source: `L['self']`, then
    `._modules[...]` steps, then `._parameters[k]` or `._buffers[k]`; None for other sources."""
    node = ast.parse(source, mode="eval").body
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("_parameters", "_buffers")):
        return None
    step = node.value.value
    while isinstance(step, ast.Subscript) and isinstance(step.value, ast.Attribute) and (
            step.value.attr == "_modules" and isinstance(step.slice, ast.Constant)):
        step = step.value.value
    if not (isinstance(step, ast.Subscript) and isinstance(step.value, ast.Name)
            and step.value.id == "L" and isinstance(step.slice, ast.Constant)
            and step.slice.value == "self"):
        return None
    return ast.unparse(node.value), node.slice.value


class InputGatherer:
    """Gathers every graph input from the forward's locals `L`, as one compiled function.

    A parameter or buffer is read from its module's `_parameters` / `_buffers` dict on every
    call, so a replaced parameter is seen; the dicts themselves are looked up once per `self`
    (walking ~200 `._modules` chains took ~0.35 ms of a decode step, measured). A submodule
    replaced after tracing is not seen, as the traced graph is not re-traced for it either."""

    def __init__(self, sources: list[str]):
        bad = [s for s in sources if not is_safe_source(s)]
        if bad:
            raise ValueError(f"graph input source(s) not supported for a saved graph: {bad[:3]}")
        containers: dict[str, int] = {}  # dict expression -> index in C
        items = []
        for source in sources:
            leaf = _leaf_container(source)
            if leaf is None:
                items.append(source)
            else:
                index = containers.setdefault(leaf[0], len(containers))
                items.append(f"C[{index}][{leaf[1]!r}]")
        namespace: dict = {}
        exec(compile(f"def graph_inputs(L, C):\n    return [{', '.join(items)}]\n\n"
                     f"def containers(L):\n    return [{', '.join(containers)}]\n",
                     "<kiln saved graph inputs>", "exec"), namespace)
        self._gather, self._containers = namespace["graph_inputs"], namespace["containers"]
        self._root: object = None  # the `self` the containers were looked up for
        self._cached: list = []

    def __call__(self, L: dict) -> list:
        root = L.get("self")
        if root is None or root is not self._root:
            self._cached, self._root = self._containers(L), root
        return self._gather(L, self._cached)


def has_side_effects(code: types.CodeType) -> bool:
    return any(ins.opname in _SIDE_EFFECT_OPS for ins in dis.get_instructions(code))


def output_spec(result: Any, graph_outputs: Any) -> list[int] | int | None:
    """How `result` (the forward's return) is built from the graph's outputs, by identity:
    i when it is output i, a list of indices for a tuple of outputs, else None."""
    if not isinstance(graph_outputs, (tuple, list)):
        return None
    position = {id(o): i for i, o in enumerate(graph_outputs)}
    if isinstance(result, torch.Tensor):
        return position.get(id(result))
    if type(result) is tuple and result:
        indices = [position.get(id(r)) for r in result]
        return None if None in indices or not all(
            isinstance(r, torch.Tensor) for r in result) else indices
    return None


def forward_locals_template(forward: types.FunctionType) -> tuple[list[str], dict] | None:
    """Parameter names (self first) and defaults of `forward`; None for *args / **kwargs."""
    names, defaults = [], {}
    for name, p in inspect.signature(forward).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return None
        names.append(name)
        if p.default is not p.empty:
            defaults[name] = p.default
    return names, defaults


class SavedGraphRunner:
    """Calls the stitched graph straight from the forward's arguments: no Dynamo, no guards."""

    def __init__(self, graph: Callable, input_fn: Callable, output: list[int] | int,
                 forward: types.FunctionType):
        template = forward_locals_template(forward)
        if template is None:
            raise ValueError("forward takes *args or **kwargs")
        self.graph, self.input_fn, self.output = graph, input_fn, output
        self.names, self.defaults = template

    def inputs(self, module, args: tuple, kwargs: dict) -> list:
        frame_locals = dict(self.defaults)
        frame_locals.update(zip(self.names, (module, *args)))
        frame_locals.update(kwargs)
        return self.input_fn(frame_locals)

    def __call__(self, module, *args, **kwargs):
        outputs = self.graph(*self.inputs(module, args, kwargs))
        if isinstance(self.output, int):
            return outputs[self.output]
        return tuple(outputs[i] for i in self.output)


def entry_name(*factors: Any) -> str:
    """File name of the entry pointing a (config, compiler, rank, prefix) at its cache key."""
    return hashlib.sha256(repr(factors).encode()).hexdigest()[:16] + ".json"


def write_entry(path: Path, key: str, traced_files: list[str]) -> None:
    atomic_write_text(path, json.dumps({"key": key, "traced_files": traced_files}, indent=1))


def read_entry(path: Path) -> tuple[str, list[str]] | None:
    try:
        entry = json.loads(path.read_text())
        return entry["key"], list(entry["traced_files"])
    except FileNotFoundError:
        return None


def save_plan(cache: CompileCache, plan: SavedPlan, graph_bytes: bytes) -> None:
    """Graph first, plan last (both atomic), under the cache's lock: a reader that finds the
    plan finds its graph, never another process's (the pickled graph differs between
    processes)."""
    directory = cache.dir
    data = asdict(plan)
    data["graph_sha256"] = hashlib.sha256(graph_bytes).hexdigest()
    data["plan_sha256"] = _plan_digest(data)
    with cache.locked():
        tmp = directory / f".{GRAPH_FILE}.{os.getpid()}.tmp"
        tmp.write_bytes(graph_bytes)
        tmp.replace(directory / GRAPH_FILE)
        atomic_write_text(directory / PLAN_FILE, json.dumps(data, indent=1))


def _plan_digest(data: dict) -> str:
    """Checksum of the plan's own fields: an edited plan (an output index, an input source)
    would fail at the first forward, on every start, rather than trace again."""
    fields = {k: v for k, v in data.items() if k != "plan_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def load_plan(cache: CompileCache) -> tuple[SavedPlan, CodeOnlyGraph]:
    """The plan and its split graph, code-only (see graph_pickle.py), read under the cache's
    lock where it can be taken (not in a read-only cache). Raises (FileNotFoundError,
    ValueError, unpickling errors) when absent or damaged."""
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            stack.enter_context(cache.locked())
        return _load_plan(cache.dir)


def _load_plan(directory: Path) -> tuple[SavedPlan, CodeOnlyGraph]:
    data = json.loads((directory / PLAN_FILE).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory / PLAN_FILE} is not a saved graph plan of format "
                         f"{FORMAT_VERSION}")
    if data.pop("plan_sha256", None) != _plan_digest(data):
        raise ValueError(f"{directory / PLAN_FILE} does not match its recorded checksum")
    graph_bytes = (directory / GRAPH_FILE).read_bytes()
    if hashlib.sha256(graph_bytes).hexdigest() != data.pop("graph_sha256", None):
        raise ValueError(f"{directory / GRAPH_FILE} does not match its recorded checksum")
    graph = graph_pickle.loads(graph_bytes)
    if not isinstance(graph, CodeOnlyGraph):
        raise ValueError(f"{directory / GRAPH_FILE} holds {type(graph).__name__}, not a graph")
    return SavedPlan(**data), graph
