"""`KilnBackend`: the Dynamo backend of mode 3 (KILN_COMPILE).

It keys the disk cache, installs the post-grad pass manager, splits the graph at the splitting
ops, compiles (or loads) each non-splitting piece per shape, and returns the stitched graph.
"""
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx

from kiln import envs
from kiln.compilation import graph_cache, monitor
from kiln.compilation.cache import (CompileCache, cache_base_dir, compute_cache_key,
                                    private_inductor_cache_dir)
from kiln.compilation.compiler_interface import make_compiler
from kiln.compilation.counters import compilation_counter
from kiln.compilation.passes import (FuseAddRmsNormLinear, FuseSiluMulLinear,
                                     PostGradPassManager)
from kiln.compilation.piecewise import PieceCompiler, PiecewiseBackend
from kiln.compilation.split import SplitItem, split_graph
from kiln.logger import init_logger

logger = init_logger(__name__)


def wrap_piece(piece_callable: Callable, piece_index: int, is_last: bool,
               kiln_config=None) -> Callable:
    """Seam for CUDA graphs (kiln/cudagraphs/wrapper.py): wrap a compiled piece for capture
    when a piecewise graph mode asks for it. Without graph support the piece runs as is."""
    if kiln_config is None:
        return piece_callable
    from kiln.cudagraphs.wrapper import wrap_piece_for_cudagraph

    return wrap_piece_for_cudagraph(piece_callable, kiln_config.compilation_config,
                                    is_last=is_last, name=f"piece_{piece_index}")


def fusion_passes_apply(kiln_config) -> bool:
    """Whether compiled graphs get the passes that fold what comes before a linear into it: on
    CPU, where the fused ops' C++ kernels run (elsewhere their torch fallbacks would be slower
    than Inductor's kernels), unless pass_config {"enable_fusion": false}."""
    from kiln.native import linear_op

    cc = kiln_config.compilation_config
    return (cc.pass_config.get("enable_fusion", True)
            and torch.device(kiln_config.device_config.device).type == "cpu"
            and linear_op.available())


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


class KilnBackend:
    """One instance per compiled model instance; `prefix` names its cache subdirectory."""

    def __init__(self, kiln_config, prefix: str):
        self.kiln_config, self.prefix = kiln_config, prefix
        cc = kiln_config.compilation_config
        self.pass_manager = PostGradPassManager(cc.pass_config)
        if fusion_passes_apply(kiln_config):
            self.pass_manager.add(FuseAddRmsNormLinear())
            self.pass_manager.add(FuseSiluMulLinear())
        self.compiler = make_compiler(cc.backend, self.pass_manager,
                                      kiln_config.device_config.device)
        self.pieces: dict[int, PiecewiseBackend] = {}  # piece index -> compiled piece
        self.split_items: list[SplitItem] = []
        self.cache: CompileCache | None = None
        self.cache_key: str | None = None
        self.traced: list[str] = []  # source files Dynamo traced (part of the cache key)
        self.saved_graph: dict | None = None  # what a cold trace saves for warm starts
        self.graph_outputs: Any = None  # the stitched graph's first outputs (see save_traced)
        if cc.debug_dump_path and hasattr(self.compiler, "dump_dir"):
            self.compiler.dump_dir = (Path(cc.debug_dump_path) / f"rank_"
                                      f"{kiln_config.parallel_config.rank}" / prefix)

    def traced_files(self) -> list[str]:
        from torch._guards import TracingContext

        codes = TracingContext.get().traced_code or []
        return sorted({c.co_filename for c in codes if os.path.exists(c.co_filename)})

    def key_for(self, traced_files: list[str]) -> str:
        return compute_cache_key(self.kiln_config.compute_hash(), traced_files,
                                 self.compiler.compute_hash(), self.kiln_config.device_config.device)

    def _open_cache(self, key: str) -> CompileCache | None:
        if envs.disable_compile_cache():
            # Inductor's cache too: nothing a previous process compiled may be reused.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_inductor_cache_dir())
            logger.info("compile cache disabled by KILN_DISABLE_COMPILE_CACHE")
            return None
        cc = self.kiln_config.compilation_config
        key_dir = cache_base_dir(cc.cache_dir) / key
        try:
            cache = CompileCache(key_dir, self.kiln_config.parallel_config.rank, self.prefix)
            cache.check_writable()
        except OSError as e:  # read-only, full, or not a directory: serve, compiling afresh
            logger.warning("compile cache %s cannot be written (%s); compiling without a cache. "
                           "Point KILN_CACHE_ROOT (or compilation_config.cache_dir) at a "
                           "writable directory", key_dir, e)
            return None
        # Inductor's cache (compiled .so files) lives under the key so a warm start runs no gcc.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.inductor_cache_dir)
        monitor.log_cache_dir(cache.dir, cache.was_warm)
        return cache

    def piece_compiler(self) -> PieceCompiler:
        cc = self.kiln_config.compilation_config
        return PieceCompiler(self.compiler, self.cache, dict(cc.inductor_compile_config),
                             cc.warmup_phase)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compilation_counter.num_graphs_seen += 1
        cc = self.kiln_config.compilation_config
        self.traced = self.traced_files()
        self.cache_key = self.key_for(self.traced)
        self.cache = self._open_cache(self.cache_key)
        inputs = graph_cache.graph_inputs(gm)
        split_gm, self.split_items = split_graph(gm, cc.splitting_ops)
        self.saved_graph = self._pickle_split_graph(split_gm, inputs)
        compiled_items = [it for it in self.split_items if not it.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(self.split_items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(compiled_items)
        if self.cache is not None:
            self.cache.write_text("split_graph.py", split_gm.print_readable(print_output=False))
        self._dump(split_gm)

        piece_compiler = self.piece_compiler()
        max_tokens = self.kiln_config.scheduler_config.max_num_batched_tokens
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
                    piece = PiecewiseBackend(item.graph, item.graph_id, list(args),
                                             piece_compiler, cc.compile_sizes, max_tokens)
                    backend.pieces[item.graph_id] = piece
                    split_gm.__dict__[target] = wrap_piece(piece, item.graph_id,
                                                           item.graph_id == last, backend.kiln_config)
                return output

        fakes = fake_example_inputs(example_inputs)
        from torch._guards import TracingContext
        with TracingContext.get().fake_mode:
            _Compile(split_gm).run(*fakes)
        call_splitting_pieces_directly(split_gm)
        if self.saved_graph is None:
            return split_gm

        def first_outputs(*args):
            # Keeps the stitched graph's outputs so save_traced can tell, by identity, which
            # of them the forward returns.
            outputs = split_gm(*args)
            if backend.saved_graph is not None and backend.graph_outputs is None:
                backend.graph_outputs = outputs
            return outputs
        return first_outputs

    def _pickle_split_graph(self, split_gm: fx.GraphModule, inputs) -> dict | None:
        if self.cache is None or inputs is None:
            return None
        try:
            return {"bytes": pickle.dumps(split_gm), "sources": inputs[0], "meta": inputs[1]}
        except Exception as e:  # an unpicklable target: warm starts will trace again
            logger.info("traced graph of %s not saved for warm starts (%s: %s)", self.prefix,
                        type(e).__name__, e)
            return None

    def save_traced(self, forward, result: Any, signature: str, bytecode) -> None:
        """Called by the wrapper after the cold trace's first call (see warm_start.py)."""
        from kiln.compilation import warm_start

        warm_start.save_traced(self, forward, result, signature, bytecode)

    def load_saved(self, module, forward, args: tuple, kwargs: dict,
                   signature: str) -> Callable | None:
        """Called by the wrapper instead of tracing; None means trace (see warm_start.py)."""
        from kiln.compilation import warm_start

        return warm_start.load_saved(self, module, forward, args, kwargs, signature)

    def _dump(self, split_gm: fx.GraphModule) -> None:
        path = self.kiln_config.compilation_config.debug_dump_path
        if not path:
            return
        out = Path(path) / f"rank_{self.kiln_config.parallel_config.rank}" / self.prefix
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
