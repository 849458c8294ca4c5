"""Trace a model's forward once with Dynamo, then call Dynamo's transformed bytecode directly
(or, on a warm start, the graph an earlier process traced and the backend saved).

After the first call no step re-enters Dynamo (no guards, no frame hook); inputs are checked
against what was traced, since a mismatch would otherwise run compiled code on the wrong types.
"""
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from kiln.compilation import monitor
from kiln.compilation.counters import compilation_counter
from kiln.compilation.inductor_patches import forget_backend
from kiln.compilation.op_schemas import stock_options
from kiln.compilation.phase import RecompileAfterWarmupError, WarmupPhase
from kiln.logger import init_logger

logger = init_logger(__name__)


def fresh_function(fn: types.FunctionType) -> types.FunctionType:
    """A copy of `fn` with its own code object, so Dynamo's cache entries for it belong to one
    model instance (another instance of the class gets its own trace and backend)."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(x):
        if isinstance(x, torch.Tensor):
            return (x.dtype, x.dim(), x.device)
        return None if x is None else type(x)
    return tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items()))


class TraceOnceWrapper:
    """Compiles `forward` (an unbound function) for `module` on the first call; afterwards
    calls the transformed bytecode. `backend` is a Dynamo backend (KilnBackend, "inductor")."""

    def __init__(self, module: torch.nn.Module, forward: types.FunctionType, backend: Any,
                 prefix: str, phase: WarmupPhase, inductor_config: dict | None = None):
        """`inductor_config`: compilation_config.inductor_compile_config, for a stock backend
        (KilnBackend applies it to each piece itself)."""
        self.module, self.backend, self.prefix, self.phase = module, backend, prefix, phase
        self.inductor_config = inductor_config
        self.source_fn = fresh_function(forward)
        self.direct: Callable | None = None
        self.traced_signature: tuple | None = None

    def __call__(self, *args, **kwargs):
        if self.direct is not None:
            signature = _signature(args, kwargs)
            if signature != self.traced_signature:
                raise RecompileAfterWarmupError(self._mismatch(signature))
            return self.direct(self.module, *args, **kwargs)
        self.phase.check_may_compile(f"tracing {self.prefix}.forward")
        if self._load_saved(args, kwargs):
            return self.direct(self.module, *args, **kwargs)
        return self._trace(args, kwargs)

    def _load_saved(self, args: tuple, kwargs: dict) -> bool:
        """A warm start: take the graph an earlier process traced (same cache key), if the
        backend saved one, instead of tracing."""
        load = getattr(self.backend, "load_saved", None)
        if load is None:
            return False
        signature = _signature(args, kwargs)
        try:
            runner = load(self.module, self.source_fn, args, kwargs, repr(signature))
        except Exception as e:  # a damaged cache must not stop the model: trace instead
            logger.warning("saved graph of %s unusable (%s: %s); tracing with Dynamo instead",
                           self.prefix, type(e).__name__, e)
            runner = None
        if runner is None:
            return False
        self.direct, self.traced_signature = runner, signature
        return True

    def _trace(self, args: tuple, kwargs: dict):
        captured: list[types.CodeType] = []

        def hook(code: types.CodeType, new_code: types.CodeType):
            if code is self.source_fn.__code__:
                captured.append(new_code)

        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        compiled = torch.compile(self.source_fn, fullgraph=True, backend=self.backend,
                                 options=stock_options(self.backend, self.inductor_config))
        spent_before = monitor.stats.compile_s + monitor.stats.load_s
        try:
            with monitor.Timer() as t:
                output = compiled(self.module, *args, **kwargs)
        finally:
            handle.remove()
            # Nothing re-enters Dynamo for this forward once traced (a recompile is an error).
            forget_backend(self.backend)
        compilation_counter.num_dynamo_traces += 1
        if not captured:
            raise RuntimeError(f"Dynamo produced no bytecode for {self.prefix}.forward")
        fn = self.source_fn
        self.direct = types.FunctionType(captured[-1], _detached_globals(fn), fn.__name__,
                                         fn.__defaults__, fn.__closure__)
        self.direct.__kwdefaults__ = fn.__kwdefaults__
        self.traced_signature = _signature(args, kwargs)
        save = getattr(self.backend, "save_traced", None)
        if save is not None:
            try:
                save(self.source_fn, output, repr(self.traced_signature), captured[-1])
            except Exception as e:  # saving is an optimisation; serving goes on without it
                logger.warning("could not save the traced graph of %s for warm starts (%s: %s)",
                               self.prefix, type(e).__name__, e)
        # The backend's compiles/loads ran inside the trace; report them apart.
        monitor.log_trace(self.prefix, t.seconds - (monitor.stats.compile_s + monitor.stats.load_s
                                                    - spent_before))
        return output

    def _mismatch(self, signature: tuple) -> str:
        return (f"{self.prefix}.forward was traced for inputs {self.traced_signature} and got "
                f"{signature} (dtype, ndim, device per argument); that would need a recompile, "
                "which Kiln does not do once traced. Call the model with the traced dtypes, or "
                "run with enforce_eager=True.")


class GuardedCompileWrapper:
    """Mode 1 (stock torch.compile): Dynamo with its normal guards on every call; once warm-up
    is over a recompile raises (torch.compiler stance "fail_on_recompile")."""

    def __init__(self, module: torch.nn.Module, forward: types.FunctionType, backend: str,
                 prefix: str, phase: WarmupPhase, inductor_config: dict | None = None):
        self.module, self.prefix, self.phase = module, prefix, phase
        self.compiled = torch.compile(fresh_function(forward), fullgraph=True, backend=backend,
                                      options=stock_options(backend, inductor_config))
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if not self.phase.serving:
            self.calls += 1
            # A call that made a graph traced and compiled it (the backend compiles inside
            # Dynamo): its time is the trace's, else the total said "took 0.00 s".
            graphs = counters["stats"]["unique_graphs"]
            with monitor.Timer() as t:
                output = self.compiled(self.module, *args, **kwargs)
            if counters["stats"]["unique_graphs"] != graphs:
                monitor.log_trace(f"{self.prefix} (and compiled it)", t.seconds)
            return output
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(self.module, *args, **kwargs)
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e) and "Detected recompile" not in str(e):
                raise
            raise RecompileAfterWarmupError(
                f"{self.prefix}.forward would recompile after warm-up ended: {e}") from e


def _detached_globals(fn: types.FunctionType) -> dict[str, Any]:
    """Globals for the traced bytecode of `fn` that do not keep the model alive.

    Dynamo stores the compiled graph in `fn`'s module globals, where the bytecode looks it up,
    and removes it only when the code's cache entries go; the graph reaches the backend, the
    model and its KV caches, so those would outlive the engine. The bytecode gets a copy of the
    globals, taken now, and the entries of `fn`'s code (its own: fresh_function) are dropped,
    which takes the graph out of the module. Kiln calls the bytecode directly from here on.
    """
    scope = dict(fn.__globals__)
    torch._dynamo.reset_code(fn.__code__)
    return scope
