"""`PostGradPassManager`: Kiln's passes, installed as Inductor's post_grad_custom_pre_pass.

Pre, not post: on CPU Inductor's own post-grad passes fold adds into addmm before a post pass
could match them. Its uuid (pass list and sources, each pass's own factors such as the IR ops'
chosen implementations, Kiln's op schemas, pass config, shape) enters Inductor's cache key
and Kiln's.
"""
import hashlib
import inspect
import json

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.compilation.op_schemas import schemas_hash


class KilnInductorPass:
    """Base of a Kiln pass: a callable on an FX graph whose uuid is the hash of its module's
    source, of the modules in `helper_modules` (what it calls there changes its output) and of
    `factors()`. `matched` counts what it rewrote in the graph it last ran on."""
    helper_modules: tuple = ()
    matched = 0

    def __call__(self, graph: fx.Graph) -> None:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__

    def factors(self) -> dict:
        return {}

    def uuid(self) -> str:
        modules = (inspect.getmodule(type(self)), *self.helper_modules)
        source = "".join(inspect.getsource(m) for m in modules)
        source += json.dumps(self.factors(), sort_keys=True, default=str)
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

    def uuid(self) -> str:
        factors = {"manager": hashlib.sha256(inspect.getsource(type(self)).encode()).hexdigest(),
                   "op_schemas": schemas_hash(),
                   "passes": [(p.name, p.uuid()) for p in self.passes],
                   "pass_config": self.pass_config, "shape": self.shape}
        return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()
                              ).hexdigest()[:16]
