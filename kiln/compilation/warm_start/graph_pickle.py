"""Unpickling a saved split graph without torch.fx re-tracing it: each GraphModule comes back
as a `CodeOnlyGraph` that runs the Python source fx generated for it, and nothing else.

fx's own unpickler symbolically traces every module's source again to rebuild its Graph: ~0.35 s
for the default model's 62 pieces on every warm start. The graph it rebuilds is not the one
Dynamo traced either (fx evaluates ops on constants, such as `torch.arange(8)`, into tensors,
and AOTAutograd's cache refused a rebuilt piece, so Inductor could not save what it compiled).
A saved graph is therefore run, never compiled: a piece that needs compiling sends the warm
start back to Dynamo (see warm_start.py).
"""
import io
import linecache
import pickle
from collections.abc import Callable
from typing import Any

import torch


class CodeOnlyGraph(torch.nn.Module):
    """A GraphModule as pickled: its state (parameters, buffers, submodules) and the Python
    source fx generated for it. Calling it runs that source, exactly what the GraphModule ran."""

    def __init__(self, body: dict[str, Any], import_block: str):
        super().__init__()
        self.__dict__.update(body)  # nn.Module state, submodules and attributes, as saved
        self.__dict__["_kiln_source"] = import_block + (body.get("_code") or body["code"])
        self.__dict__["_kiln_forward"] = None

    def _compiled_forward(self) -> Callable:
        source = self._kiln_source
        name = f"<kiln saved graph {id(self):x}>"
        # Registered like fx's own generated code, so tracebacks show the failing line.
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec", dont_inherit=True), namespace)
        self.__dict__["_kiln_forward"] = namespace["forward"]
        return namespace["forward"]

    def forward(self, *args, **kwargs):
        fn = self._kiln_forward or self._compiled_forward()
        return fn(self, *args, **kwargs)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.fx.graph_module", "reduce_graph_module"):
            return CodeOnlyGraph  # called as reduce_graph_module(body, import_block) would be
        return super().find_class(module, name)


def loads(data: bytes) -> torch.nn.Module:
    """Unpickle bytes written by `pickle.dumps(graph_module)`, every GraphModule code-only."""
    return _Unpickler(io.BytesIO(data)).load()
