"""`CUDAGraphWrapper` records a callable once per batch descriptor and replays it; the capture
phase it may record in. The dispatcher (dispatcher.py) decides per step; wrappers trust the
forward context.
"""
import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import torch

from kiln import envs
from kiln.compilation.counters import compilation_counter
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.forward_context import get_forward_context, is_forward_context_available
from kiln.logger import init_logger

logger = init_logger(__name__)


# ---- capture phase -------------------------------------------------------------------------

_capture_phase_active = False


def is_capture_phase_active() -> bool:
    return _capture_phase_active


@contextlib.contextmanager
def capture_phase(mem_get_info: Callable[[], tuple[int, int]] | None = None):
    """The only window in which wrappers may record graphs (the worker's capture step).

    Freezes the garbage collector so objects that exist now are never scanned during the many
    captures; logs how many graphs were recorded, the time and the device memory they took.
    """
    global _capture_phase_active
    if _capture_phase_active:
        raise RuntimeError("capture_phase() is already active; it cannot be nested")
    gc.collect()
    gc.freeze()
    captured_before = compilation_counter.num_cudagraph_captured
    free_before = mem_get_info()[0] if mem_get_info else None
    start = time.perf_counter()
    _capture_phase_active = True
    try:
        yield
    finally:
        _capture_phase_active = False
        gc.unfreeze()
    elapsed = time.perf_counter() - start
    num = compilation_counter.num_cudagraph_captured - captured_before
    if free_before is not None:
        used_gib = (free_before - mem_get_info()[0]) / 2**30
        logger.info("Captured %d CUDA graphs in %.2f s, using %.3f GiB of device memory",
                    num, elapsed, used_gib)
    else:
        logger.info("Captured %d CUDA graphs in %.2f s", num, elapsed)


# ---- weak references -----------------------------------------------------------------------

def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing t's memory without owning it (t's storage may be freed under it).

    Graph outputs live in the shared graph pool; holding them weakly lets the next (smaller)
    capture reuse that memory. Valid only until the same memory is written again: by the next
    replay of any graph in the pool, so callers consume outputs before the next step.
    """
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride())


def weak_ref_tensors(value: Any) -> Any:
    """weak_ref_tensor applied through tuples and lists; other values pass unchanged."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, (tuple, list)):
        return type(value)(weak_ref_tensors(v) for v in value)
    return value


def _tensor_addresses(args: tuple) -> list[int | None]:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


# ---- the wrapper ---------------------------------------------------------------------------

_global_graph_pool = None


def get_global_graph_pool():
    """One memory pool for every graph in the process: captures reuse each other's memory."""
    global _global_graph_pool
    if _global_graph_pool is None:
        _global_graph_pool = torch.cuda.graph_pool_handle()
    return _global_graph_pool


@dataclasses.dataclass
class _GraphEntry:
    graph: Any  # torch.cuda.CUDAGraph
    output: Any  # weak references into the graph pool
    input_addresses: list[int | None]


class CUDAGraphWrapper:
    """Records `runnable` once per BatchDescriptor, then replays; bound to one runtime mode.

    graph_pool None: the process-wide pool (get_global_graph_pool), fetched at first capture.

    When the step's runtime mode (forward context) differs from this wrapper's, it calls
    straight through, which is how a FULL wrapper around the model and PIECEWISE wrappers around
    its pieces coexist. Graph inputs must sit at the same addresses at every replay (the model
    runner's persistent buffers); `debug` checks that.
    """

    def __init__(self, runnable: Callable, runtime_mode: "CUDAGraphMode | str | int",
                 graph_pool: Any = None, *, weak_ref_output: bool = False, name: str = "",
                 debug: bool | None = None):
        mode = CUDAGraphMode.parse(runtime_mode)
        if mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"CUDAGraphWrapper runtime_mode must be PIECEWISE or FULL; got "
                             f"{mode.name}")
        self.runnable = runnable
        self.runtime_mode = mode
        self.graph_pool = graph_pool
        self.weak_ref_output = weak_ref_output
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.debug = envs.cudagraph_debug() if debug is None else debug
        self._entries: dict[BatchDescriptor, _GraphEntry] = {}

    def __getattr__(self, key: str):
        # Only reached for attributes the wrapper lacks: behave like the wrapped module.
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(key)
        return getattr(runnable, key)

    def unwrap(self) -> Callable:
        return self.runnable

    @property
    def captured_descriptors(self) -> list[BatchDescriptor]:
        return list(self._entries)

    def __call__(self, *args, **kwargs):
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode = ctx.cudagraph_runtime_mode
        if mode is None or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        descriptor = ctx.batch_descriptor
        if descriptor is None:
            raise RuntimeError(f"forward context asks for {mode.name} graphs but carries no "
                               f"batch_descriptor; the model runner must set both from the "
                               f"dispatcher")
        entry = self._entries.get(descriptor)
        if entry is None:
            return self._capture(descriptor, args, kwargs)
        return self._replay(descriptor, entry, args)

    def _capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict):
        if not is_capture_phase_active():
            raise RuntimeError(
                f"CUDA graph capture of {self.name!r} ({self.runtime_mode.name}, {descriptor}) "
                f"outside the capture phase: the worker must capture every dispatcher key inside "
                f"capture_phase() before serving; set compilation_config.cudagraph_mode=NONE to "
                f"run without graphs")
        graph = torch.cuda.CUDAGraph()
        pool = self.graph_pool if self.graph_pool is not None else get_global_graph_pool()
        with contextlib.ExitStack() as stack:
            # torch.cuda.graph collects garbage and empties the cache on entry: slow, and
            # pointless with the collector frozen for the whole capture phase.
            stack.enter_context(patch("gc.collect", lambda *a, **k: 0))
            stack.enter_context(patch("torch.cuda.empty_cache", lambda: None))
            stack.enter_context(torch.cuda.graph(graph, pool=pool))
            output = self.runnable(*args, **kwargs)
            if self.weak_ref_output:
                # Release the last output's memory back to the pool now; the caller reads it
                # before anything else can be recorded there.
                output = weak_ref_tensors(output)
        self._entries[descriptor] = _GraphEntry(graph=graph, output=weak_ref_tensors(output),
                                                input_addresses=_tensor_addresses(args))
        compilation_counter.num_cudagraph_captured += 1
        logger.debug("captured %s graph of %s for %s", self.runtime_mode.name, self.name,
                     descriptor)
        return output

    def _replay(self, descriptor: BatchDescriptor, entry: _GraphEntry, args: tuple):
        if self.debug:
            now = _tensor_addresses(args)
            moved = [i for i, (a, b) in enumerate(zip(now, entry.input_addresses)) if a != b]
            if moved or len(now) != len(entry.input_addresses):
                raise RuntimeError(
                    f"CUDA graph replay of {self.name!r} for {descriptor}: input(s) {moved} are "
                    f"not at their capture-time addresses; graph inputs must be slices of the "
                    f"model runner's persistent buffers (KILN_CUDAGRAPH_DEBUG check)")
        entry.graph.replay()
        if self.runtime_mode is CUDAGraphMode.FULL:
            compilation_counter.num_cudagraph_replays_full += 1
        else:
            compilation_counter.num_cudagraph_replays_piecewise += 1
        return entry.output


def wrap_piece_for_cudagraph(piece: Callable, cudagraph_mode: CUDAGraphMode, *, is_last: bool,
                             name: str = "") -> Callable:
    """The piecewise backend's hook: wrap a compiled piece when PIECEWISE graphs are on.

    `cudagraph_mode` is the resolved mode (the model runner's dispatcher's), not the request.
    """
    if not cudagraph_mode.has_piecewise_cudagraphs():
        return piece
    return CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, weak_ref_output=is_last, name=name)


def wrap_model_for_full_cudagraph(model: Callable, cudagraph_mode: CUDAGraphMode) -> Callable:
    """The model runner's hook: wrap the whole model forward when the resolved mode has FULL
    graphs."""
    if not cudagraph_mode.has_full_cudagraphs():
        return model
    return CUDAGraphWrapper(model, CUDAGraphMode.FULL, weak_ref_output=True,
                            name=type(model).__name__)
