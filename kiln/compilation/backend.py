"""`KilnBackend`: the Dynamo backend of mode 3 (KILN_COMPILE).

It keys the disk cache, installs the post-grad pass manager, splits the graph at the splitting
ops, compiles (or loads) each non-splitting piece per shape, and returns the stitched graph.
"""
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln import envs
from kiln.compilation import monitor
from kiln.compilation.cache import (
    CompileCache,
    cache_base_dir,
    compiled_graph_key,
    private_inductor_cache_dir,
    rank_dir_of,
)
from kiln.compilation.compile_state import CompileState
from kiln.compilation.compiler_interface import make_compiler
from kiln.compilation.counters import compilation_counter
from kiln.compilation.passes import (
    FuseAddRmsNormLinear,
    FuseSiluMulLinear,
    LowerIrOps,
    PostGradPassManager,
    early_passes,
    late_passes,
)
from kiln.compilation.piecewise import PieceCompiler, PiecewiseBackend
from kiln.compilation.split import SplitItem, split_graph
from kiln.compilation.warm_start import SavedGraph, WarmStart
from kiln.config.inductor_options import inductor_options
from kiln.cudagraphs.wrapper import wrap_piece_for_cudagraph
from kiln.logger import init_logger

logger = init_logger(__name__)


def fusion_passes(kiln_config) -> list:
    """The passes that fold an IR op into the linear IR op after it (`linear`, `gguf_linear`),
    where both ops' chosen implementations are the native ones the fused op's C++ kernel stands
    for (elsewhere its torch fallback would be slower than Inductor's kernels); none under
    pass_config {"enable_fusion": false}."""
    from kiln.native import linear_op

    cc = kiln_config.compilation_config
    chosen = kiln_config.ir_selection.as_dict()
    linears = tuple(op for op in ("linear", "gguf_linear") if chosen[op] == "native")
    if not (cc.pass_config.get("enable_fusion", True) and linears
            and torch.device(kiln_config.device_config.device).type == "cpu"
            and linear_op.available()):
        return []
    return ([FuseAddRmsNormLinear(linears)] if chosen["fused_add_rms_norm"] == "native" else []) + (
        [FuseSiluMulLinear(linears)] if chosen["silu_and_mul"] == "native" else [])


def call_splitting_pieces_directly(split_gm: torch.nn.Module) -> None:
    """Let the split graph call its splitting-op pieces' forward without nn.Module.__call__
    (hooks and tracing state, which never apply to them) and its attribute lookup: 92 -> 36 us
    a step for the default model's 30 attention pieces, the split graph's own run measured
    alone. The compiled pieces are already plain attributes (their PiecewiseBackend)."""
    for name, module in list(split_gm.named_children()):
        if name not in split_gm.__dict__:
            split_gm.__dict__[name] = module.forward


def fake_example_inputs(example_inputs: list[Any]) -> list[Any]:
    """Fake copies of Dynamo's real example inputs in the tracing context's fake mode, keeping
    their symbolic dims (running on Dynamo's own fakes mixes fake modes)."""
    from torch._dynamo.source import ConstantSource
    from torch._guards import TracingContext

    ctx = TracingContext.get()
    fake_mode = ctx.fake_mode
    fakes = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor):
            sym_ctx = ctx.tensor_to_context.get(x) if hasattr(ctx, "tensor_to_context") else None
            fakes.append(fake_mode.from_tensor(x, symbolic_context=sym_ctx,
                                               source=ConstantSource(f"kiln_input_{i}")))
        else:
            fakes.append(x)
    return fakes


@contextlib.contextmanager
def shape_guards_dropped(shape_env):
    """Leave out of Dynamo's guards what compiling the pieces adds to its shape env. The pieces'
    sizes are symbols of Kiln's fake inputs, which Dynamo has no source for: a guard on one (on
    GPU, Triton's 32-bit indexing check `64*s <= 2**31 - 1`) fails Dynamo's guard building.
    Kiln never evaluates Dynamo's guards (it calls the traced bytecode), and the token counts it
    runs stay within max_num_batched_tokens, which such a guard bounds far above."""
    before = len(shape_env.guards) if shape_env is not None else 0
    try:
        yield
    finally:
        if shape_env is not None:
            del shape_env.guards[before:]


class KilnBackend:
    """One instance per compiled model instance; `prefix` names its cache subdirectory, `state`
    is its engine's (warm-up phase, resolved graph mode)."""

    def __init__(self, kiln_config, prefix: str, state: CompileState | None = None):
        self.kiln_config, self.prefix = kiln_config, prefix
        self.state = state if state is not None else CompileState()
        cc = kiln_config.compilation_config
        self.pass_manager = PostGradPassManager(cc.pass_config)
        for graph_pass in [*early_passes(kiln_config), *fusion_passes(kiln_config)]:
            self.pass_manager.add(graph_pass)
        self.pass_manager.add(LowerIrOps(kiln_config.ir_selection))
        for graph_pass in late_passes(kiln_config):
            self.pass_manager.add(graph_pass)
        self.compiler = make_compiler(cc.backend, self.pass_manager,
                                      kiln_config.device_config.device)
        self.pieces: dict[int, PiecewiseBackend] = {}  # piece index -> compiled piece
        self.split_items: list[SplitItem] = []
        self.cache: CompileCache | None = None
        self.cache_key: str | None = None
        self.traced: list[str] = []  # source files Dynamo traced (part of the cache key)
        self.inductor_dir: Path | None = None  # Inductor's cache while compiling (None: its own)
        self.warm_start = WarmStart(kiln_config, prefix, self.compiler)
        if cc.debug_dump_path and hasattr(self.compiler, "dump_dir"):
            self.compiler.dump_dir = (Path(cc.debug_dump_path)
                                      / rank_dir_of(kiln_config.parallel_config) / prefix)

    def traced_files(self) -> list[str]:
        from torch._guards import TracingContext

        codes = TracingContext.get().traced_code or []
        return sorted({c.co_filename for c in codes if os.path.exists(c.co_filename)})

    def key_for(self, traced_files: list[str]) -> str:
        return compiled_graph_key(self.kiln_config, self.compiler, traced_files)

    def _open_cache(self, key: str) -> CompileCache | None:
        """The compile cache under `key` (None: disabled or unwritable), and where Inductor's
        own cache is while this backend compiles and loads (self.inductor_dir)."""
        self.inductor_dir = None  # Inductor's usual place
        if envs.disable_compile_cache():
            # Inductor's cache too: nothing a previous process compiled may be reused.
            self.inductor_dir = private_inductor_cache_dir()
            logger.info("compile cache disabled by KILN_DISABLE_COMPILE_CACHE")
            return None
        cc = self.kiln_config.compilation_config
        key_dir = cache_base_dir(cc.cache_dir) / key
        try:
            cache = CompileCache(key_dir, rank_dir_of(self.kiln_config.parallel_config),
                                 self.prefix)
            cache.check_writable()
        except OSError as e:  # read-only, full, or not a directory: serve, compiling afresh
            logger.warning("compile cache %s cannot be written (%s); compiling without a cache. "
                           "Point KILN_CACHE_ROOT (or compilation_config.cache_dir) at a "
                           "writable directory", key_dir, e)
            return None
        # Inductor's cache (compiled .so files) lives under the key so a warm start runs no gcc.
        self.inductor_dir = cache.inductor_cache_dir
        if cache.was_warm:
            cache.drop_cut_libraries()
        monitor.log_cache_dir(cache.dir, cache.was_warm, self.inductor_dir)
        return cache

    def piece_compiler(self) -> PieceCompiler:
        return PieceCompiler(self.compiler, self.cache, inductor_options(self.kiln_config),
                             self.state.warmup_phase, self.inductor_dir)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compilation_counter.num_graphs_seen += 1
        cc = self.kiln_config.compilation_config
        self.traced = self.traced_files()
        self.cache_key = self.key_for(self.traced)
        self.cache = self._open_cache(self.cache_key)
        split_gm, self.split_items = split_graph(gm, cc.splitting_ops)
        self.warm_start.record_split(gm, split_gm, keep=self.cache is not None)
        if self.cache is not None:
            self.cache.write_text("split_graph.py", split_gm.print_readable(print_output=False))
        compiled_items = [it for it in self.split_items if not it.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(self.split_items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(compiled_items)
        self._dump(split_gm)

        piece_compiler = self.piece_compiler()
        names = {it.submod_name: it for it in compiled_items}
        last = compiled_items[-1].graph_id if compiled_items else -1
        backend = self

        class _Compile(torch.fx.Interpreter):
            # Propagates fake inputs through the split graph; each compiled piece is compiled
            # with the fake inputs it receives, then replaced by its PiecewiseBackend.
            def call_module(self, target, args, kwargs):
                output = super().call_module(target, args, kwargs)
                item = names.get(target)
                if item is not None:
                    backend._install_piece(split_gm, target, item.graph, item.graph_id,
                                           item.graph_id == last, piece_compiler,
                                           example_inputs=list(args))
                return output

        fakes = fake_example_inputs(example_inputs)
        from torch._guards import TracingContext
        fake_mode = TracingContext.get().fake_mode
        with fake_mode, shape_guards_dropped(fake_mode.shape_env):
            _Compile(split_gm).run(*fakes)
        call_splitting_pieces_directly(split_gm)
        return self.warm_start.observe_first_outputs(split_gm)

    def _install_piece(self, split_gm, submod: str, graph: torch.nn.Module, graph_id: int,
                       is_last: bool, piece_compiler: PieceCompiler,
                       example_inputs: list | None = None, saved: dict | None = None) -> None:
        """Compile (or load) one piece and put it in the split graph in place of its module;
        `saved` (from a saved graph) replaces the example inputs."""
        piece = PiecewiseBackend(graph, graph_id, example_inputs, piece_compiler,
                                 self.kiln_config.compilation_config.compile_sizes,
                                 self.kiln_config.scheduler_config.max_num_batched_tokens,
                                 saved=saved)
        self.pieces[graph_id] = piece
        # Wrapped for capture when the resolved graph mode has PIECEWISE graphs.
        split_gm.__dict__[submod] = wrap_piece_for_cudagraph(
            piece, self.state.cudagraph_mode, is_last=is_last, name=f"piece_{graph_id}")

    def save_traced(self, forward, result: Any, signature: str, bytecode) -> None:
        """Called by the wrapper after the cold trace's first call: save it for warm starts."""
        if self.cache is None:
            return
        self.warm_start.save(forward, result, signature, bytecode, cache=self.cache,
                             key=self.cache_key, traced=self.traced, pieces=self.pieces)

    def load_saved(self, module, forward, args: tuple, kwargs: dict,
                   signature: str) -> Callable | None:
        """Called by the wrapper instead of tracing: the stitched graph of an earlier trace
        with this cache key, fed straight from the forward's arguments; None means trace."""
        spent_before = monitor.stats.load_s
        with monitor.Timer() as t:
            saved = self.warm_start.find(module, forward, args, kwargs, signature)
            if saved is None or not self._install_saved(saved):
                return None
        compilation_counter.num_saved_graph_loads += 1
        monitor.log_graph_load(self.prefix, t.seconds - (monitor.stats.load_s - spent_before))
        return saved.runner

    def _install_saved(self, saved: SavedGraph) -> bool:
        """Load every compiled piece of a saved graph from the cache; False (trace) on failure."""
        cache = self._open_cache(saved.key)
        if cache is None:  # unwritable: its artifacts cannot load (see _open_cache)
            return False
        self.cache, self.cache_key, self.traced = cache, saved.key, saved.traced
        split_gm = saved.split_gm
        try:
            piece_compiler = self.piece_compiler()
            compiled = {p["submod"] for p in saved.pieces}
            self.split_items = [SplitItem(name, int(name.replace("submod_", "")),
                                          name not in compiled, module)
                                for name, module in split_gm.named_children()]
            compilation_counter.num_piecewise_graphs_seen += len(self.split_items)
            compilation_counter.num_piecewise_capturable_graphs_seen += len(saved.pieces)
            last = saved.pieces[-1]["graph_id"] if saved.pieces else -1
            for p in saved.pieces:
                self._install_piece(split_gm, p["submod"], getattr(split_gm, p["submod"]),
                                    p["graph_id"], p["graph_id"] == last, piece_compiler,
                                    saved=p)
            call_splitting_pieces_directly(split_gm)
        except Exception as e:
            logger.warning("saved graph in %s could not be rebuilt (%s: %s); tracing with "
                           "Dynamo instead", cache.dir, type(e).__name__, e)
            self.pieces.clear()
            return False
        return True

    def _dump(self, split_gm: fx.GraphModule) -> None:
        path = self.kiln_config.compilation_config.debug_dump_path
        if not path:
            return
        out = Path(path) / rank_dir_of(self.kiln_config.parallel_config) / self.prefix
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "split_graph.py").write_text(split_gm.print_readable(print_output=False))
            for it in self.split_items:
                kind = "splitting" if it.is_splitting_graph else "compiled"
                (out / f"piece_{it.graph_id}_{kind}.py").write_text(
                    it.graph.print_readable(print_output=False))
        except OSError as e:  # a debugging aid: never a reason not to serve
            logger.warning("debug_dump_path %s cannot be written (%s); not dumping", path, e)
            if hasattr(self.compiler, "dump_dir"):
                self.compiler.dump_dir = None
