"""Warm starts without Dynamo, for KilnBackend: save what the cold trace produced, and later
rebuild the stitched graph from the cache and feed it straight from the forward's arguments.
"""
from pathlib import Path
from typing import Any, Callable

from kiln import envs
from kiln.compilation import graph_cache, monitor
from kiln.compilation.cache import CompileCache, cache_base_dir
from kiln.compilation.compiler_interface import file_sha256
from kiln.compilation.counters import compilation_counter
from kiln.compilation.graph_pickle import CodeOnlyGraph
from kiln.compilation.piecewise import PiecewiseBackend
from kiln.compilation.split import SplitItem
from kiln.logger import init_logger

logger = init_logger(__name__)


def entry_path(backend) -> Path:
    """Where a cold trace records its cache key and traced files: the key hashes traced
    sources, which a warm start must know before (instead of) tracing."""
    cc, rank = backend.kiln_config.compilation_config, backend.kiln_config.parallel_config.rank
    name = graph_cache.entry_name(backend.kiln_config.compute_hash(),
                                  backend.compiler.compute_hash(),
                                  backend.kiln_config.device_config.device, rank, backend.prefix)
    return cache_base_dir(cc.cache_dir) / "saved_graphs" / name


def save_traced(backend, forward, result: Any, signature: str, bytecode) -> None:
    """After the cold trace's first call: save what a warm start needs to skip Dynamo."""
    saved, backend.saved_graph = backend.saved_graph, None
    graph_outputs, backend.graph_outputs = backend.graph_outputs, None
    if saved is None or backend.cache is None:
        return
    output = graph_cache.output_spec(result, graph_outputs)
    why = ("its result is not made of graph outputs" if output is None else
           "Dynamo replays side effects after the graph" if graph_cache.has_side_effects(
               bytecode) else "forward takes *args/**kwargs"
           if graph_cache.forward_locals_template(forward) is None else
           "an input source is not a plain lookup" if not all(
               map(graph_cache.is_safe_source, saved["sources"])) else None)
    if why is not None:
        logger.info("traced graph of %s not saved for warm starts: %s", backend.prefix, why)
        return
    pieces = [{"submod": f"submod_{i}", "graph_id": i, "fingerprint": p.fingerprint,
               "size_arg": p.size_arg} for i, p in sorted(backend.pieces.items())]
    plan = graph_cache.SavedPlan(saved["sources"], output, signature, pieces, saved["meta"])
    graph_cache.save_plan(backend.cache.dir, plan, saved["bytes"])
    graph_cache.write_entry(entry_path(backend), backend.cache_key, backend.traced)
    logger.info("saved the traced graph of %s for warm starts in %s", backend.prefix,
                backend.cache.dir)


def load_saved(backend, module, forward, args: tuple, kwargs: dict,
               signature: str) -> Callable | None:
    """The stitched graph of an earlier trace with this cache key, fed straight from the
    forward's arguments; None (trace instead) when absent, stale or damaged."""
    if envs.disable_compile_cache():
        return None
    if backend.kiln_config.compilation_config.debug_dump_path:
        # The dump is written as Dynamo's graph reaches the backend: trace (artifacts still load).
        logger.info("debug_dump_path is set: tracing %s with Dynamo so the dump is written",
                    backend.prefix)
        return None
    entry = graph_cache.read_entry(entry_path(backend))
    if entry is None:
        return None
    key, traced = entry
    if backend.key_for(traced) != key:
        logger.info("sources traced for %s changed since they were saved; tracing again",
                    backend.prefix)
        return None
    spent_before = monitor.stats.load_s
    with monitor.Timer() as t:
        runner = _rebuild(backend, key, traced, module, forward, args, kwargs, signature)
    if runner is not None:
        compilation_counter.num_saved_graph_loads += 1
        monitor.log_graph_load(backend.prefix, t.seconds - (monitor.stats.load_s - spent_before))
    return runner


def _rebuild(backend, key: str, traced: list[str], module, forward, args, kwargs,
             signature: str):
    try:
        cache = CompileCache(cache_base_dir(backend.kiln_config.compilation_config.cache_dir)
                             / key, backend.kiln_config.parallel_config.rank, backend.prefix)
        plan, split_gm = graph_cache.load_plan(cache.dir)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as e:
        logger.warning("saved graph in %s failed to load (%s: %s); tracing with Dynamo "
                       "instead", cache.dir, type(e).__name__, e)
        return None
    if plan.signature != signature:
        logger.info("%s was traced for inputs %s, called with %s; tracing again",
                    backend.prefix, plan.signature, signature)
        return None
    # A saved graph cannot be compiled (see graph_pickle.py): every artifact must be there.
    missing = missing_artifacts(cache, backend.compiler, plan.pieces,
                                backend.kiln_config.compilation_config.compile_sizes)
    if missing:
        log = logger.warning if "range" in missing else logger.info  # new sizes are no damage
        log("compiled artifacts in %s are missing or damaged ({shape: pieces} %s); tracing with "
            "Dynamo to compile them", cache.dir, missing)
        return None
    try:
        runner = graph_cache.SavedGraphRunner(
            split_gm, graph_cache.InputGatherer(plan.sources), plan.output, forward)
        # Dynamo would guard on these; a model whose weights differ in dtype or shape
        # under the same key (another quantization, say) must be traced afresh.
        mismatch = graph_cache.meta_mismatch(plan.input_meta, [
            graph_cache.input_meta(x) for x in runner.inputs(module, args, kwargs)])
        if mismatch is not None:
            logger.info("saved graph of %s does not fit this model (%s); tracing again",
                        backend.prefix, mismatch)
            return None
        backend.cache, backend.cache_key, backend.traced = backend._open_cache(key), key, traced
        if backend.cache is None:  # unwritable: its artifacts cannot load (see _open_cache)
            return None
        _install_pieces(backend, split_gm, plan.pieces)
    except Exception as e:
        logger.warning("saved graph in %s could not be rebuilt (%s: %s); tracing with "
                       "Dynamo instead", cache.dir, type(e).__name__, e)
        backend.pieces.clear()
        return None
    return runner


def _install_pieces(backend, split_gm: CodeOnlyGraph, pieces: list[dict]) -> None:
    from kiln.compilation.backend import call_splitting_pieces_directly, wrap_piece

    piece_compiler = backend.piece_compiler()
    max_tokens = backend.kiln_config.scheduler_config.max_num_batched_tokens
    compiled = {p["submod"] for p in pieces}
    backend.split_items = [SplitItem(name, int(name.replace("submod_", "")),
                                     name not in compiled, module)
                           for name, module in split_gm.named_children()]
    compilation_counter.num_piecewise_graphs_seen += len(backend.split_items)
    compilation_counter.num_piecewise_capturable_graphs_seen += len(pieces)
    last = pieces[-1]["graph_id"] if pieces else -1
    for p in pieces:
        graph = getattr(split_gm, p["submod"])
        piece = PiecewiseBackend(graph, p["graph_id"], None, piece_compiler,
                                 backend.kiln_config.compilation_config.compile_sizes,
                                 max_tokens, saved=p)
        backend.pieces[p["graph_id"]] = piece
        split_gm.__dict__[p["submod"]] = wrap_piece(piece, p["graph_id"],
                                                    p["graph_id"] == last, backend.kiln_config)
    call_splitting_pieces_directly(split_gm)


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
    handle = cache.lookup(shape, piece["graph_id"], compiler.name)
    if handle is None or handle.get("fingerprint") != piece["fingerprint"]:
        return False
    if handle["file"] not in intact:
        path = cache.artifact_path(handle["file"])
        intact[handle["file"]] = path.exists() and (
            "sha256" not in handle or file_sha256(path) == handle["sha256"])
    return intact[handle["file"]]
