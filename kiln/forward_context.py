"""The per-step forward context: attention metadata, layer table and graph mode for one forward.

The attention custom op looks up its layer by name here, which keeps per-step and per-layer data
out of the traced graph. Setting a context while one is active is an error.
"""
import contextlib
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


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention ran outside a forward context; the model runner must call "
                           "the model inside set_forward_context()")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kiln_config, *,
                        layers: dict[str, Any], batch_descriptor=None,
                        cudagraph_runtime_mode=None):
    """`layers`: layer name -> Attention module (kiln.model.layers.attention.attention_layers)."""
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context() is not re-entrant: a forward context is active")
    if "ir_selection" in kiln_config.__dict__:  # this engine's IR op choices (kiln/ir/)
        apply_ir_selection(kiln_config.ir_selection)
    _forward_context = ForwardContext(
        no_compile_layers=layers,
        attn_metadata=attn_metadata, batch_descriptor=batch_descriptor,
        cudagraph_runtime_mode=cudagraph_runtime_mode)
    context = _forward_context
    try:
        yield context
    finally:
        _forward_context = None
        for callback in context.on_exit:
            callback()
