"""`CompileState`: what one engine's compile stack holds while it runs, apart from its (frozen)
settings: the warm-up phase and the CUDA graph mode the model runner resolved.

The model runner owns one and makes it current while it builds the model; each compiled class
keeps the one current at its construction (a model built alone gets a fresh one).
"""
import contextlib
from dataclasses import dataclass, field

from kiln.compilation.phase import WarmupPhase
from kiln.cudagraphs.mode import CUDAGraphMode


@dataclass(eq=False)
class CompileState:
    warmup_phase: WarmupPhase = field(default_factory=WarmupPhase)
    # Resolved (the runner's dispatcher decided it): whether compiled pieces are wrapped for
    # PIECEWISE graphs; never the requested compilation_config.cudagraph_mode.
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE


_current: CompileState | None = None


@contextlib.contextmanager
def set_compile_state(state: CompileState):
    """Models built inside the block compile under `state`."""
    global _current
    previous, _current = _current, state
    try:
        yield state
    finally:
        _current = previous


def current_compile_state() -> CompileState:
    """The state set by the enclosing set_compile_state, or a fresh one of its own."""
    return _current if _current is not None else CompileState()


def compile_state_of(module) -> CompileState:
    """The compile state a @support_torch_compile module was built under."""
    state = getattr(module, "_kiln_compile_state", None)
    if state is None:
        raise TypeError(f"{type(module).__name__} is no @support_torch_compile model")
    return state
