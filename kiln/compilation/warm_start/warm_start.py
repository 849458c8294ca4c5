"""`WarmStart`: one compiled model's warm starts without Dynamo: what its cold trace saves, and
the stitched graph a later process rebuilds from the cache and feeds from the forward's arguments.
"""
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from kiln import envs
from kiln.compilation.cache import (
    KILN_ROOT,
    CompileCache,
    cache_base_dir,
    compiled_graph_key,
    rank_dir_of,
)
from kiln.compilation.compiler_interface import CompilerInterface, file_sha256
from kiln.compilation.warm_start import graph_cache
from kiln.compilation.warm_start.graph_pickle import CodeOnlyGraph
from kiln.logger import init_logger

logger = init_logger(__name__)


@dataclass
class SavedGraph:
    """A saved trace found usable for this call: what the backend installs its pieces into."""
    key: str  # the compile cache key it was traced under
    traced: list[str]  # the source files it was traced from
    split_gm: CodeOnlyGraph
    pieces: list[dict]  # {"submod", "graph_id", "fingerprint", "size_arg"} per compiled piece
    runner: graph_cache.SavedGraphRunner


class WarmStart:
    """Owns the warm-start state of one compiled model (one KilnBackend): the cold trace's
    pickled split graph until the first call's result shows how the forward returns it, and
    where the saved trace's entry lives. The backend calls it; it never calls the backend."""

    def __init__(self, kiln_config, prefix: str, compiler: CompilerInterface):
        self.kiln_config, self.prefix, self.compiler = kiln_config, prefix, compiler
        self._pending: dict | None = None  # {"bytes", "sources", "meta"} of the cold trace
        self._graph_outputs: Any = None  # the stitched graph's first outputs

    def entry_path(self) -> Path:
        """Where a cold trace records its cache key and traced files: the key hashes traced
        sources, which a warm start must know before (instead of) tracing."""
        cfg = self.kiln_config
        name = graph_cache.entry_name(cfg.compute_hash(), self.compiler.compute_hash(),
                                      cfg.device_config.device, cfg.parallel_config.rank,
                                      self.prefix, KILN_ROOT)  # checkouts keep their own
        return cache_base_dir(cfg.compilation_config.cache_dir) / "saved_graphs" / name

    # ---- the cold trace ----------------------------------------------------------------------

    def record_split(self, gm: fx.GraphModule, split_gm: fx.GraphModule, keep: bool) -> None:
        """Keep (when `keep`: the compile cache is on) the split graph, pickled now, before its
        pieces are compiled, and its inputs' sources, for saving once the first call has run."""
        self._pending, self._graph_outputs = None, None
        inputs = graph_cache.graph_inputs(gm) if keep else None
        if inputs is None:
            return
        try:
            self._pending = {"bytes": pickle.dumps(split_gm), "sources": inputs[0],
                             "meta": inputs[1]}
        except Exception as e:  # an unpicklable target: warm starts will trace again
            logger.info("traced graph of %s not saved for warm starts (%s: %s)", self.prefix,
                        type(e).__name__, e)

    def observe_first_outputs(self, split_gm: Callable) -> Callable:
        """`split_gm`, keeping its first outputs so `save` can tell, by identity, which of them
        the forward returns (itself when nothing is pending)."""
        if self._pending is None:
            return split_gm

        def first_outputs(*args):
            outputs = split_gm(*args)
            if self._pending is not None and self._graph_outputs is None:
                self._graph_outputs = outputs
            return outputs
        return first_outputs

    def save(self, forward, result: Any, signature: str, bytecode, *, cache: CompileCache,
             key: str, traced: list[str], pieces: dict) -> None:
        """After the cold trace's first call: save what a warm start needs to skip Dynamo.
        `pieces`: graph id -> PiecewiseBackend of the compiled pieces."""
        saved, self._pending = self._pending, None
        graph_outputs, self._graph_outputs = self._graph_outputs, None
        if saved is None:
            return
        output = graph_cache.output_spec(result, graph_outputs)
        why = ("its result is not made of graph outputs" if output is None else
               "Dynamo replays side effects after the graph" if graph_cache.has_side_effects(
                   bytecode) else "forward takes *args/**kwargs"
               if graph_cache.forward_locals_template(forward) is None else
               "an input source is not a plain lookup" if not all(
                   map(graph_cache.is_safe_source, saved["sources"])) else None)
        if why is not None:
            logger.info("traced graph of %s not saved for warm starts: %s", self.prefix, why)
            return
        piece_list = [{"submod": f"submod_{i}", "graph_id": i, "fingerprint": p.fingerprint,
                       "size_arg": p.size_arg} for i, p in sorted(pieces.items())]
        plan = graph_cache.SavedPlan(saved["sources"], output, signature, piece_list,
                                     saved["meta"])
        graph_cache.save_plan(cache, plan, saved["bytes"])
        graph_cache.write_entry(self.entry_path(), key, traced)
        logger.info("saved the traced graph of %s for warm starts in %s", self.prefix, cache.dir)

    # ---- a warm start ------------------------------------------------------------------------

    def find(self, module, forward, args: tuple, kwargs: dict,
             signature: str) -> SavedGraph | None:
        """The saved trace with this cache key, checked against this call; None (trace instead)
        when absent, stale, damaged or not fitting."""
        if envs.disable_compile_cache():
            return None
        cfg = self.kiln_config
        if cfg.compilation_config.debug_dump_path:
            # The dump is written as Dynamo's graph reaches the backend: trace (artifacts load).
            logger.info("debug_dump_path is set: tracing %s with Dynamo so the dump is written",
                        self.prefix)
            return None
        entry = graph_cache.read_entry(self.entry_path())
        if entry is None:
            return None
        key, traced = entry
        if compiled_graph_key(cfg, self.compiler, traced) != key:
            logger.info("sources traced for %s changed since they were saved; tracing again",
                        self.prefix)
            return None
        return self._check(key, traced, module, forward, args, kwargs, signature)

    def _check(self, key: str, traced: list[str], module, forward, args, kwargs,
               signature: str) -> SavedGraph | None:
        cfg = self.kiln_config
        try:
            cache = CompileCache(cache_base_dir(cfg.compilation_config.cache_dir) / key,
                                 rank_dir_of(cfg.parallel_config), self.prefix)
            plan, split_gm = graph_cache.load_plan(cache)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as e:
            logger.warning("saved graph in %s failed to load (%s: %s); tracing with Dynamo "
                           "instead", cache.dir, type(e).__name__, e)
            return None
        if plan.signature != signature:
            logger.info("%s was traced for inputs %s, called with %s; tracing again",
                        self.prefix, plan.signature, signature)
            return None
        # A saved graph cannot be compiled (see graph_pickle.py): every artifact must be there.
        missing = missing_artifacts(cache, self.compiler, plan.pieces,
                                    cfg.compilation_config.compile_sizes)
        if missing:
            log = logger.warning if "range" in missing else logger.info  # new sizes: no damage
            log("compiled artifacts in %s are missing or damaged ({shape: pieces} %s); tracing "
                "with Dynamo to compile them", cache.dir, missing)
            return None
        try:
            runner = graph_cache.SavedGraphRunner(
                split_gm, graph_cache.InputGatherer(plan.sources), plan.output, forward)
            # Dynamo would guard on these; a model whose weights differ in dtype or shape
            # under the same key (another quantization, say) must be traced afresh.
            mismatch = graph_cache.meta_mismatch(plan.input_meta, [
                graph_cache.input_meta(x) for x in runner.inputs(module, args, kwargs)])
        except Exception as e:
            logger.warning("saved graph in %s could not be rebuilt (%s: %s); tracing with "
                           "Dynamo instead", cache.dir, type(e).__name__, e)
            return None
        if mismatch is not None:
            logger.info("saved graph of %s does not fit this model (%s); tracing again",
                        self.prefix, mismatch)
            return None
        return SavedGraph(key, traced, split_gm, plan.pieces, runner)


def missing_artifacts(cache: CompileCache, compiler, pieces: list[dict],
                      compile_sizes: list[int]) -> dict[str | int, list[int]]:
    """{"range" or compile size: [piece ids]} whose saved artifact is absent or damaged."""
    missing: dict[str | int, list[int]] = {}
    intact: dict[str, bool] = {}  # artifact file -> checksum holds (identical pieces share one)
    for piece in pieces:
        sizes = compile_sizes if piece["size_arg"] is not None else []
        for shape in [None, *sizes]:
            if not saved_artifact_ok(cache, compiler, piece, shape, intact):
                missing.setdefault("range" if shape is None else shape, []).append(
                    piece["graph_id"])
    return missing


def saved_artifact_ok(cache: CompileCache, compiler, piece: dict, shape: int | None,
                      intact: dict[str, bool]) -> bool:
    """Whether a piece's artifact for `shape` (None: the range) is indexed, of the same graph
    and intact on disk (each file checked once, its verdict kept in `intact`)."""
    if compiler.name == "eager":
        return True
    handle = cache.lookup(shape, piece["graph_id"], compiler.name, piece["fingerprint"])
    if handle is None or handle.get("fingerprint") != piece["fingerprint"]:
        return False
    if handle["file"] not in intact:
        path = cache.artifact_path(handle["file"])
        intact[handle["file"]] = path.exists() and (
            "sha256" not in handle or file_sha256(path) == handle["sha256"])
    return intact[handle["file"]]
