"""`@support_torch_compile`: makes a model class compile its forward lazily, per the config.

Mode 0 runs eager; 1 plain torch.compile; 2 one Dynamo trace, guards dropped; 3 KilnBackend.
The token dim (dim 0 of every Tensor-annotated forward argument) is dynamic and shared.
"""
import inspect
import typing
from collections.abc import Callable

import torch

from kiln.compilation.compile_state import current_compile_state
from kiln.config import CompilationMode, get_current_kiln_config

NUM_TOKENS_SHAPE_ID = "kiln_num_tokens"


def _is_tensor_annotation(annotation) -> bool:
    if annotation is torch.Tensor:
        return True
    if isinstance(annotation, str):
        return "Tensor" in annotation
    return torch.Tensor in typing.get_args(annotation)  # Optional[Tensor], Tensor | None


def infer_dynamic_arg_dims(forward: Callable) -> dict[str, list[int]]:
    """Dim 0 of every forward argument annotated as a Tensor (or Optional Tensor)."""
    try:
        hints = typing.get_type_hints(forward)
    except Exception:  # unresolved forward references: fall back to the raw annotations
        hints = {}
    dims = {}
    for name, param in inspect.signature(forward).parameters.items():
        if name != "self" and _is_tensor_annotation(hints.get(name, param.annotation)):
            dims[name] = [0]
    return dims


def mark_dynamic_args(forward: Callable, dynamic_arg_dims: dict[str, list[int]], args: tuple,
                      kwargs: dict, unbacked: bool) -> None:
    """Mark the token dims dynamic; unbacked ones (mode 1) share one symbol via shape_id and
    avoid the 0/1 specialisation that would recompile for a single token."""
    bound = inspect.signature(forward).bind(None, *args, **kwargs)
    for name, dims in dynamic_arg_dims.items():
        value = bound.arguments.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        for dim in dims:
            dim = dim % value.dim()
            if unbacked:
                torch._dynamo.decorators.mark_unbacked(value, dim, shape_id=NUM_TOKENS_SHAPE_ID)
            else:
                torch._dynamo.mark_dynamic(value, dim)


def ignore_torch_compile(cls: type) -> type:
    """Opt a subclass of a @support_torch_compile class out of compiling."""
    cls._kiln_ignore_compile = True
    return cls


def support_torch_compile(cls: type | None = None, *,
                          dynamic_arg_dims: dict[str, int | list[int]] | None = None,
                          enable_if: Callable | None = None):
    """Class decorator; usable bare or with arguments. `enable_if(kiln_config) -> bool`."""
    def decorate(cls: type) -> type:
        dims = ({k: [v] if isinstance(v, int) else list(v) for k, v in dynamic_arg_dims.items()}
                if dynamic_arg_dims is not None else infer_dynamic_arg_dims(cls.forward))
        if not dims:
            raise ValueError(f"{cls.__name__}.forward has no Tensor-annotated argument; pass "
                             "dynamic_arg_dims to @support_torch_compile")
        unknown = set(dims) - set(inspect.signature(cls.forward).parameters)
        if unknown:
            raise ValueError(f"dynamic_arg_dims names {sorted(unknown)}, which "
                             f"{cls.__name__}.forward does not take")
        original_init, original_call = cls.__init__, cls.__call__
        cls._kiln_ignore_compile = False

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            config = kwargs.get("kiln_config") or get_current_kiln_config()
            mode = config.compilation_config.mode
            self._kiln_config = config
            self._kiln_compile_state = current_compile_state()
            self._kiln_compile = None
            self._kiln_dynamic_arg_dims = dims
            enabled = (mode != CompilationMode.NONE and not type(self)._kiln_ignore_compile
                       and (enable_if is None or enable_if(config)))
            self._kiln_compile_enabled = enabled
            if enabled:
                # A new model starts a new warm-up for its engine (its first call compiles).
                self._kiln_compile_state.warmup_phase.reset()

        def __call__(self, *args, **kwargs):
            if not self._kiln_compile_enabled or torch.compiler.is_compiling():
                return original_call(self, *args, **kwargs)
            if self._kiln_compile is None:
                self._kiln_compile = _make_wrapper(self, self._kiln_config,
                                                   self._kiln_compile_state)
                mark_dynamic_args(type(self).forward, self._kiln_dynamic_arg_dims, args, kwargs,
                                  unbacked=self._kiln_config.compilation_config.mode
                                  == CompilationMode.STOCK_TORCH_COMPILE)
            return self._kiln_compile(*args, **kwargs)

        cls.__init__, cls.__call__ = __init__, __call__
        return cls

    return decorate(cls) if cls is not None else decorate


def _make_wrapper(module: torch.nn.Module, config, state) -> Callable:
    from kiln.compilation import preload

    preload.wait()  # the engine core may be importing the compile stack on a thread
    from kiln.compilation.backend import KilnBackend
    from kiln.compilation.wrapper import GuardedCompileWrapper, TraceOnceWrapper

    cc = config.compilation_config
    forward, prefix, phase = type(module).forward, type(module).__name__, state.warmup_phase
    if cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
        return GuardedCompileWrapper(module, forward, cc.backend, prefix, phase,
                                     cc.inductor_compile_config)
    if cc.mode == CompilationMode.DYNAMO_TRACE_ONCE:
        return TraceOnceWrapper(module, forward, cc.backend, prefix, phase,
                                cc.inductor_compile_config)
    return TraceOnceWrapper(module, forward, KilnBackend(config, prefix, state), prefix, phase)
