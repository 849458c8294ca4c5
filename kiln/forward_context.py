"""The per-step forward context: attention metadata, layer table and graph mode for one forward.

The attention custom op looks up its layer by name here, which keeps per-step and per-layer data
out of the traced graph. Setting a context while this thread's is active is an error; another
thread's (a second in-process engine, KILN_ENABLE_V1_MULTIPROCESSING=0) is waited for.
"""
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.attention.metadata import AttentionMetadata
from kiln.ir.selection import apply as apply_ir_selection


@dataclass
class ForwardContext:
    # layer name -> Attention module (owns its kv_cache tensor and backend impl)
    no_compile_layers: dict[str, Any]
    attn_metadata: AttentionMetadata | None  # None: profiling / warm-up run, no KV I/O
    batch_descriptor: Any = None  # kiln.cudagraphs.mode.BatchDescriptor
    cudagraph_runtime_mode: Any = None  # kiln.cudagraphs.mode.CUDAGraphMode
    # Called as the context closes, even on an error: undo per-step state kept elsewhere.
    on_exit: list[Callable[[], None]] = field(default_factory=list)
    # One per KV cache group (kiln/core/kv_cache_groups.py), attn_metadata the first; a layer
    # reads its group's (its kv_group). None: one group, attn_metadata for every layer.
    group_metadata: list[AttentionMetadata] | None = None

    def layer_metadata(self, layer) -> AttentionMetadata | None:
        if self.group_metadata is None:
            return self.attn_metadata
        return self.group_metadata[layer.kv_group]


_forward_context: ForwardContext | None = None
# The context is process-wide (the attention op reads it from any thread): two engines stepping
# in two threads of one process take turns. Without the lock the second thread's step failed,
# or, between the first's check and its set, replaced the first's context mid-forward.
_turn = threading.Lock()
_holder: int | None = None  # the thread whose forward holds _turn


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention ran outside a forward context; the model runner must call "
                           "the model inside set_forward_context()")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def ir_selection_turn(selection):
    """Hold the forward turn with `selection` bound: building and loading a model read the IR
    binding, and applying another engine's choices outside the turn rebound the ops of a
    forward running in another thread."""
    global _holder
    if _holder == threading.get_ident():
        raise RuntimeError("a model cannot be built inside a forward context")
    with _turn:
        _holder = threading.get_ident()
        try:
            apply_ir_selection(selection)
            yield
        finally:
            _holder = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kiln_config, *,
                        layers: dict[str, Any], batch_descriptor=None,
                        cudagraph_runtime_mode=None):
    """`layers`: layer name -> Attention module (kiln.model.layers.attention.attention_layers).
    A layer reads its KV cache group's metadata (attn_metadata.group_metadata) where there are
    several."""
    global _forward_context, _holder
    if _holder == threading.get_ident():
        raise RuntimeError("set_forward_context() is not re-entrant: a forward context is active")
    with _turn:
        _holder = threading.get_ident()
        try:
            if "ir_selection" in kiln_config.__dict__:  # this engine's IR op choices (kiln/ir/)
                apply_ir_selection(kiln_config.ir_selection)
            _forward_context = ForwardContext(
                no_compile_layers=layers,
                attn_metadata=attn_metadata, batch_descriptor=batch_descriptor,
                cudagraph_runtime_mode=cudagraph_runtime_mode,
                group_metadata=getattr(attn_metadata, "group_metadata", None))
            context = _forward_context
            try:
                yield context
            finally:
                _forward_context = None
                for callback in context.on_exit:
                    callback()
        finally:
            _holder = None
