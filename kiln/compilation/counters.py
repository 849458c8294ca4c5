"""Process-wide compilation counters, so tests (and `kiln compile`) can see what the stack did.

`compilation_counter.expect(num_inductor_compiles=0)` asserts the deltas of a block of code.
"""
import contextlib
import dataclasses


@dataclasses.dataclass
class CompilationCounter:
    num_graphs_seen: int = 0  # Dynamo graphs handed to KilnBackend
    num_piecewise_graphs_seen: int = 0  # pieces after splitting (2N+1 for N attention layers)
    num_piecewise_capturable_graphs_seen: int = 0  # compiled pieces (N+1)
    num_backend_compilations: int = 0  # (piece, shape) artifacts produced by a compiler
    num_inductor_compiles: int = 0  # calls into torch._inductor.standalone_compile
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    num_cache_hits: int = 0  # (piece, shape) served without compiling (disk or identical piece)
    num_cache_misses: int = 0  # (piece, shape) compiled: the disk cache had none usable
    num_corrupt_artifacts: int = 0  # artifacts that failed their checksum or load
    num_dynamo_traces: int = 0  # first-call traces by the support_torch_compile wrapper
    num_saved_graph_loads: int = 0  # warm starts that ran a saved graph instead of tracing
    num_cudagraph_captured: int = 0
    num_cudagraph_replays_piecewise: int = 0  # piece-graph replays (one per piece per step)
    num_cudagraph_replays_full: int = 0  # whole-forward graph replays (one per step)

    def clone(self) -> "CompilationCounter":
        return dataclasses.replace(self)

    @contextlib.contextmanager
    def expect(self, **deltas: int):
        unknown = set(deltas) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise AttributeError(f"unknown counter(s) {sorted(unknown)}")
        before = self.clone()
        yield
        for name, want in deltas.items():
            got = getattr(self, name) - getattr(before, name)
            assert got == want, f"compilation_counter.{name} changed by {got}, expected {want}"


compilation_counter = CompilationCounter()
