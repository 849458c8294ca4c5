"""Calling a compiled Inductor artifact without AOTAutograd's runtime wrapper, where that wrapper
would only stamp dynamic-dim hints on the outputs for a later Dynamo trace.

A piece's outputs go to the next piece through the split graph, never to Dynamo, so the hints
are unused; stamping them (a Python attribute on each output tensor) was ~2.8 us of a piece's
~16 us of Python per call, ~90 us a decode step of the default model. The wrapper is recognised
by its generated code's globals (torch 2.13's `_create_runtime_wrapper`): anything beyond the
hints (input mutations to apply, aliased outputs to regenerate, effect tokens, another torch's
wrapper) keeps the artifact's own call.
"""
from collections.abc import Callable
from typing import Any

import torch

# The generated wrapper's globals when it does nothing but call and stamp hints.
_PLAIN_GLOBALS = {"__builtins__", "torch", "_mark_dynamic_"}


def _cells(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    cells = {}
    for name, cell in zip(code.co_freevars, fn.__closure__):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return cells


def inner_compiled_graph(artifact: Any) -> Callable | None:
    """The CompiledFxGraph inside a standalone_compile artifact when its runtime wrapper only
    stamps output hints; None otherwise."""
    runtime_wrapper = _cells(getattr(artifact, "_compiled_fn", None)).get("compiled_fn")
    cells = _cells(runtime_wrapper)
    generated, inner = cells.get("_codegen_runtime_wrapper"), cells.get("_inner_compiled_fn")
    if generated is None or inner is None or getattr(inner, "current_callable", None) is None:
        return None
    extra = set(getattr(generated, "__globals__", {"?": None})) - _PLAIN_GLOBALS
    if any(not name.startswith("_dyn_dims_") for name in extra):
        return None
    return inner


class DirectCall:
    """Calls an artifact's generated code straight (inputs as a list, outputs as a list), after
    a first call through the artifact (which runs its one-time checks). With grad enabled, the
    artifact's own call, which turns grad off around the graph; under the profiler, the
    CompiledFxGraph's call, which labels the graph's run (otherwise it only checks for an
    autotuning compile in progress, ~1.2 us)."""

    def __init__(self, artifact: Callable, inner: Callable):
        self.artifact, self.inner, self.called = artifact, inner, False

    def __call__(self, *args):
        if not self.called or torch.is_grad_enabled():
            self.called = True
            return self.artifact(*args)
        if torch.autograd.profiler._is_profiler_enabled:
            outputs = self.inner(list(args))
        else:
            outputs = self.inner.current_callable(list(args))
        return outputs if isinstance(outputs, list) else list(outputs)


def direct_callable(artifact: Callable) -> Callable:
    """`artifact`, called without its runtime wrapper where that is safe (see the module)."""
    inner = inner_compiled_graph(artifact)
    return artifact if inner is None else DirectCall(artifact, inner)
