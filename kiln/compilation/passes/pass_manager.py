"""`PostGradPassManager`: Kiln's passes, installed as Inductor's post_grad_custom_pre_pass.

Pre, not post: on CPU Inductor's own post-grad passes fold adds into addmm before a post pass
could match them. Its uuid (pass list, each pass's own factors such as the IR ops' chosen
implementations, the sources of the passes and of the IR, Kiln's op schemas, pass config,
shape) enters Inductor's cache key and Kiln's.
"""
import functools
import hashlib
import inspect
import json
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.compilation.cache import KILN_ROOT, code_hash
from kiln.compilation.op_schemas import schemas_hash

# The Python that decides a compiled piece's code without being traced: the passes and what
# they call, and the IR's op definitions (references, fakes, in-place variants, providers'
# predicates), which lowering puts into the graph. Inductor keys its cache on the pass
# manager's uuid, not on what a pass calls: an edited IR reference loaded stale code.
GRAPH_CODE_DIRS = ("ir", "compilation/passes")


@functools.cache
def graph_code_hash(root: Path = Path(KILN_ROOT)) -> str:
    return code_hash(root, GRAPH_CODE_DIRS)


class KilnInductorPass:
    """Base of a Kiln pass: a callable on an FX graph whose uuid is the hash of its name and
    `factors()` (its source, with every pass's and the IR's, is in the manager's uuid:
    graph_code_hash). `matched` counts what it rewrote in the graph it last ran on."""
    matched = 0

    def __call__(self, graph: fx.Graph) -> None:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__

    def factors(self) -> dict:
        return {}

    def uuid(self) -> str:
        source = self.name + json.dumps(self.factors(), sort_keys=True, default=str)
        return hashlib.sha256(source.encode()).hexdigest()[:16]


# Every manager's runs, process-wide, for reports (`kiln compile`): a cache hit runs no pass.
RUNS: list[dict] = []


class PostGradPassManager(CustomGraphPass):
    def __init__(self, pass_config: dict | None = None):
        self.passes: list[KilnInductorPass] = []
        self.pass_config = dict(pass_config or {})
        self.shape: int | None = None  # the piece's compile size; None: the dynamic range
        # One entry per graph the passes ran on (a piece at a shape, compiled cold):
        # {"shape": ..., "matches": {pass name: count}}.
        self.runs: list[dict] = []

    def add(self, graph_pass: KilnInductorPass) -> None:
        self.passes.append(graph_pass)

    def set_shape(self, shape: int | None) -> None:
        self.shape = shape

    def __call__(self, graph: fx.Graph) -> None:
        matches = {}
        for graph_pass in self.passes:
            graph_pass.matched = 0
            graph_pass(graph)
            matches[graph_pass.name] = graph_pass.matched
        run = {"shape": self.shape, "matches": matches}
        self.runs.append(run)
        RUNS.append(run)

    def forget_runs_since(self, mark: int) -> None:
        """Drop the runs recorded after `mark` (len(self.runs) then): a compile that failed
        after its passes ran (Inductor can raise past them) left runs of a graph never
        served, and its retry records its own."""
        for run in self.runs[mark:]:
            for i in range(len(RUNS) - 1, -1, -1):
                if RUNS[i] is run:
                    del RUNS[i]
                    break
        del self.runs[mark:]

    def uuid(self) -> str:
        factors = {"manager": hashlib.sha256(inspect.getsource(type(self)).encode()).hexdigest(),
                   "op_schemas": schemas_hash(), "graph_code": graph_code_hash(),
                   "passes": [(p.name, p.uuid()) for p in self.passes],
                   "pass_config": self.pass_config, "shape": self.shape}
        return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()
                              ).hexdigest()[:16]
