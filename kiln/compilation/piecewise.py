"""`PiecewiseBackend`: one compiled piece, with an artifact per shape chosen at call time.

The range artifact serves [1, max_num_batched_tokens]; each compile size gets its own; an exact
size wins. `PieceCompiler` compiles or loads artifacts, sharing them between identical pieces.
"""
import collections
import errno
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.compilation import monitor
from kiln.compilation.cache import CompileCache, inductor_cache_at
from kiln.compilation.compiler_interface import CompilerInterface
from kiln.compilation.counters import compilation_counter
from kiln.compilation.phase import WarmupPhase
from kiln.logger import init_logger

logger = init_logger(__name__)


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _input_meta(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{list(x.shape)}{list(x.stride())}{x.dtype}{x.device.type}"
    return f"{type(x).__name__}"


def graph_fingerprint(gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """Hash of a piece's computation, blind to node names: identical layers hash the same."""
    names = {node: f"n{i}" for i, node in enumerate(gm.graph.nodes)}
    parts = [",".join(_input_meta(x) for x in example_inputs)]
    for node in gm.graph.nodes:
        target = "" if node.op == "placeholder" else _target_name(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        parts.append(f"{node.op}|{target}|{args!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def find_size_arg(example_inputs: list[Any]) -> tuple[int, int | None] | None:
    """Where the token count lives in a piece's inputs: (arg index, dim or None for a SymInt)."""
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt):
            return i, None
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for dim, size in enumerate(x.shape):
                if isinstance(size, torch.SymInt):
                    return i, dim
    return None


def _no_space(error: BaseException) -> bool:
    """Whether `error` or one it came from is a full disk (Inductor reports a linker's, inside a
    compile error thousands of lines long)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) \
                or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class PieceCompileError(RuntimeError):
    """A piece that could not be compiled, named with its shape and what serves without it (the
    compiler's own error, often thousands of lines of C++ output, is its cause, in the log)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        # Dynamo and the FX interpreter append their notes to args[0] on the way up ("While
        # executing %submod_0 ...", "Set TORCHDYNAMO_VERBOSE=1"): the message stays one line.
        return self.message


def unwrap_backend_error(error: BaseException) -> BaseException:
    """`error`, or what a backend raised where Dynamo wrapped it in BackendCompilerFailed (whose
    message names the backend object's address and appends Dynamo's hints)."""
    inner = getattr(error, "inner_exception", None)
    return inner if type(error).__name__ == "BackendCompilerFailed" and inner else error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class PieceCompiler:
    """Compiles or loads (piece, shape) artifacts through one compiler and one disk cache;
    Inductor's own cache is `inductor_dir` while it does (None: the process's)."""

    def __init__(self, compiler: CompilerInterface, cache: CompileCache | None,
                 inductor_config: dict, phase: WarmupPhase, inductor_dir: Path | None = None):
        self.compiler, self.cache, self.inductor_config = compiler, cache, inductor_config
        self.phase = phase  # the engine's warm-up: compiling after it is an error
        self.inductor_dir = inductor_dir
        self._memo: dict[tuple[str, int | None], Callable] = {}
        self._handles: dict[tuple[str, int | None], dict] = {}  # same keys, saved artifacts

    def get(self, piece: int, fingerprint: str, graph: fx.GraphModule, example_inputs: list,
            shape: int | None) -> Callable:
        label = "range" if shape is None else str(shape)
        memo_key = (fingerprint, shape)
        if memo_key in self._memo:
            compilation_counter.num_cache_hits += 1
            monitor.log_piece(piece, shape, "reused", 0.0)
            self._record(shape, piece, self._handles.get(memo_key))
            return self._memo[memo_key]
        fn = self.load(piece, fingerprint, graph, shape)
        if fn is None:
            self.phase.check_may_compile(f"compiling piece {piece} for shape {label}")
            save_path = None
            if self.cache is not None and self.compiler.name != "eager":
                # counted here, once per compile, however many lookups found nothing usable
                compilation_counter.num_cache_misses += 1
                save_path = self.cache.artifact_path(f"{fingerprint}_{label}.bin")
            with monitor.Timer() as t:
                fn, handle = self._compile(piece, graph, example_inputs, shape, save_path)
            compilation_counter.num_backend_compilations += 1
            monitor.log_piece(piece, shape, "compiled", t.seconds)
            if handle is not None:
                handle["fingerprint"] = fingerprint
                self._handles[memo_key] = handle
                self._record(shape, piece, handle)
        self._memo[memo_key] = fn
        return fn

    def _compile(self, piece: int, graph, example_inputs, shape, save_path):
        label = "range" if shape is None else shape
        with inductor_cache_at(self.inductor_dir):
            try:
                return self._compile_or_retry(piece, graph, example_inputs, shape, save_path)
            except PieceCompileError:
                raise
            except Exception as e:  # noqa: BLE001 - said in one line; the cause stays chained
                raise PieceCompileError(
                    f"compiling piece {piece} ({label}) failed ({_first_line(e)}); the engine's "
                    "log holds the compiler's output. --enforce-eager (-O0) serves the model "
                    "without compiling") from e

    def _compile_or_retry(self, piece: int, graph, example_inputs, shape, save_path):
        try:
            return self.compiler.compile(graph, example_inputs, self.inductor_config, shape,
                                         save_path)
        except Exception as e:  # noqa: BLE001 - retried once below, then raised
            if self.cache is None or not self.cache.inductor_cache_dir.exists():
                raise
            # Inductor's own cache under the key may hold a damaged file (a truncated .so)
            # that every compile of this piece would load again: start it afresh, once.
            logger.warning("compiling piece %d (%s) failed (%s: %s); clearing Inductor's cache "
                           "%s and compiling again", piece, "range" if shape is None else shape,
                           type(e).__name__, e, self.cache.inductor_cache_dir)
            self.cache.clear_inductor_cache()
            try:
                return self.compiler.compile(graph, example_inputs, self.inductor_config, shape,
                                             save_path)
            except Exception as again:  # noqa: BLE001 - said in one line where it is the disk
                if _no_space(again):
                    raise PieceCompileError(
                        f"compiling piece {piece} failed: no space left on the device holding "
                        f"the compile cache {self.cache.key_dir}; free space there, or point "
                        "compilation_config.cache_dir (or KILN_CACHE_ROOT, where that is not "
                        "set) at another disk") from again
                raise

    def _record(self, shape, piece, handle) -> None:
        if self.cache is not None and handle is not None:
            self.cache.record(shape, piece, self.compiler.name, handle)

    def load(self, piece: int, fingerprint: str, graph, shape) -> Callable | None:
        """The artifact from memory (identical piece) or disk, or None when it must compile."""
        if (fingerprint, shape) in self._memo:
            compilation_counter.num_cache_hits += 1
            return self._memo[(fingerprint, shape)]
        if self.cache is None or self.compiler.name == "eager":
            return None
        handle = self.cache.lookup(shape, piece, self.compiler.name, fingerprint)
        if handle is None or handle.get("fingerprint") != fingerprint:
            return None
        path = self.cache.artifact_path(handle["file"])
        label = "range" if shape is None else shape
        if not path.exists():  # deleted (a cleaned cache): a miss, not damage
            logger.warning("compiled artifact %s for piece %d (%s) is missing; recompiling it",
                           path, piece, label)
            self.cache.forget(shape, piece, self.compiler.name, fingerprint)
            return None
        try:
            with monitor.Timer() as t, inductor_cache_at(self.inductor_dir):
                fn = self.compiler.load(handle, path, graph, self.inductor_config)
        except Exception as e:  # a corrupt artifact must not stop serving: recompile instead
            compilation_counter.num_corrupt_artifacts += 1
            logger.warning("compiled artifact %s for piece %d (%s) failed to load (%s: %s); "
                           "recompiling it", path, piece, label, type(e).__name__, e)
            self.cache.forget(shape, piece, self.compiler.name, fingerprint)
            return None
        compilation_counter.num_cache_hits += 1
        self._handles[(fingerprint, shape)] = handle
        self._memo[(fingerprint, shape)] = fn
        monitor.log_piece(piece, shape, "loaded", t.seconds)
        return fn


class PiecewiseBackend:
    """Callable standing in for one compiled piece of the split graph."""

    def __init__(self, graph: torch.nn.Module, piece: int, example_inputs: list | None,
                 compiler: PieceCompiler, compile_sizes: list[int], max_num_tokens: int,
                 saved: dict | None = None):
        """`saved` ({"fingerprint", "size_arg"}, from a saved graph) replaces example inputs;
        `graph` is then code-only (warm_start/graph_pickle.py) and every artifact must load from the cache
        (the eager compiler aside, which runs the graph as it is)."""
        self.graph, self.piece, self.compiler = graph, piece, compiler
        self.compile_sizes, self.max_num_tokens = set(compile_sizes), max_num_tokens
        if saved is None:
            self.fingerprint = graph_fingerprint(graph, example_inputs)
            self.size_arg = find_size_arg(example_inputs)
            self.range_fn = compiler.get(piece, self.fingerprint, graph, example_inputs, None)
        else:
            self.fingerprint = saved["fingerprint"]
            self.size_arg = tuple(saved["size_arg"]) if saved["size_arg"] is not None else None
            if compiler.compiler.name == "eager":
                self.range_fn = compiler.get(piece, self.fingerprint, graph, [], None)
            else:
                self.range_fn = compiler.load(piece, self.fingerprint, graph, None)
            if self.range_fn is None:
                raise LookupError(f"piece {piece}: no loadable range artifact in the cache")
        self.by_size: dict[int, Callable] = {}
        if self.size_arg is not None:
            for size in sorted(self.compile_sizes):
                if compiler.cache is not None and compiler.cache.lookup(
                        size, piece, compiler.compiler.name, self.fingerprint) is not None:
                    fn = compiler.load(piece, self.fingerprint, graph, size)
                    if fn is not None:
                        self.by_size[size] = fn
                if (saved is not None and size not in self.by_size
                        and compiler.compiler.name != "eager"):
                    # A saved graph is code-only and cannot be compiled (see warm_start/graph_pickle.py).
                    raise LookupError(f"piece {piece}: no loadable artifact for size {size}")
        self.dispatch_counts: collections.Counter = collections.Counter()  # size|"range" -> n

    def num_tokens(self, args) -> int | None:
        if self.size_arg is None:
            return None
        index, dim = self.size_arg
        return int(args[index]) if dim is None else args[index].shape[dim]

    def __call__(self, *args):
        n = self.num_tokens(args)
        fn = self.by_size.get(n)
        if fn is not None:
            self.dispatch_counts[n] += 1
            return fn(*args)
        if n is not None and n in self.compile_sizes:
            fn = self.compiler.get(self.piece, self.fingerprint, self.graph, list(args), n)
            self.by_size[n] = fn
            self.dispatch_counts[n] += 1
            return fn(*args)
        if n is not None and n > self.max_num_tokens:
            raise ValueError(f"a batch of {n} tokens exceeds max_num_batched_tokens "
                             f"({self.max_num_tokens}), the range piece {self.piece} was compiled "
                             "for; raise --max-num-batched-tokens")
        self.dispatch_counts["range"] += 1
        return self.range_fn(*args)
