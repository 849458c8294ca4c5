"""Every patch Kiln applies to torch internals, in one place: three of Inductor's, one of Dynamo's.

Each names the internal it replaces and the torch versions it was checked against; a torch that
lacks the internal gets an error naming the patch (never a silently slower or leaking engine).
"""
import contextlib
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.logger import init_logger

logger = init_logger(__name__)

# 2.13.0: the CPU build this repository's tests run on. 2.11.0 (the GPU machine's) and 2.14.1:
# read in their sources (each internal present, with the signature and call sites used here).
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")


@dataclass(frozen=True)
class InternalPatch:
    """One torch internal Kiln replaces or edits, and why."""
    name: str
    module: str
    attr: str  # dotted within the module: "VecISA.check_build"
    why: str
    checked_on: tuple[str, ...] = CHECKED_ON

    def owner_and_value(self) -> tuple[Any, str, Any]:
        """(the object holding the internal, its attribute name, its current value)."""
        owner: Any = importlib.import_module(self.module)
        *path, leaf = self.attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        value = getattr(owner, leaf, None) if owner is not None else None
        if value is None:
            raise TorchInternalMissing(
                f"Kiln's patch {self.name!r} needs {self.module}.{self.attr}, which torch "
                f"{torch.__version__} does not have (checked against torch "
                f"{', '.join(self.checked_on)}); run one of those, or update "
                f"kiln/compilation/inductor_patches.py for this torch")
        return owner, leaf, value


class TorchInternalMissing(RuntimeError):
    """A torch internal one of Kiln's patches needs is absent (another torch version)."""


PRECOMPILED_HEADER = InternalPatch(
    "headers_not_precompiled", "torch._inductor.codecache", "_precompile_header",
    "loading a saved CPU artifact would preprocess (and build, if missing) a precompiled "
    "header it never uses")
VEC_ISA_CHECK_BUILD = InternalPatch(
    "remember_isa_build_probes", "torch._inductor.cpu_vec_isa", "VecISA.check_build",
    "each process would build and dlopen a test library per vector-ISA extension")
DYNAMO_CACHED_BACKENDS = InternalPatch(
    "forget_backend", "torch._dynamo.eval_frame", "cached_backends",
    "torch.compile keeps every backend (with Kiln's: the model and its KV caches) until "
    "torch._dynamo.reset()")
LAZY_KERNEL_TEMPLATES = InternalPatch(
    "lazy_kernel_templates", "torch._inductor.codegen.common",
    "KernelTemplate._template_from_string",
    "importing Inductor's lowerings builds the jinja2 template of every GPU kernel template "
    "(23; 0.1-0.2 s of each start on 2 cores), which a CPU engine never renders",
    checked_on=("2.13.0",))
PATCHES = (PRECOMPILED_HEADER, VEC_ISA_CHECK_BUILD, DYNAMO_CACHED_BACKENDS,
           LAZY_KERNEL_TEMPLATES)


def check_all() -> None:
    """Raise TorchInternalMissing for the first patch whose internal this torch lacks."""
    for patch in PATCHES:
        patch.owner_and_value()


# ---- Inductor: the precompiled kernel header -----------------------------------------------

def plain_header_path(header: str) -> str | None:
    """The header as torch ships it (`torch/include/<header>`), or None if this torch lacks it."""
    path = Path(torch.__file__).parent / "include" / header
    return str(path) if path.is_file() else None


@contextlib.contextmanager
def headers_not_precompiled():
    """Within the block, Inductor's precompiled-header lookup returns the plain header.

    Before it loads a CPU kernel library, even one already built, Inductor looks up its
    precompiled kernel header: it runs the C++ preprocessor over the header to hash it (~0.2 s
    per process) and, when the 156 MB `.gch` is missing from its temp dir (a new machine, a
    cleared /tmp), builds it (~6 s on 2 cores). Inductor only passes the path to the compiler
    (`-include <path>`), which uses a `.gch` beside it when there is one and the header's text
    otherwise, so a library that is missing after all still builds, correctly, only without the
    precompiled speed-up. The lookup is a module global: the block is not thread-safe, which
    suits loads (Kiln loads on the thread that builds the model).
    """
    codecache, name, real = PRECOMPILED_HEADER.owner_and_value()

    def plain_header(header: str, *args, **kwargs) -> str:
        path = plain_header_path(header)
        if path is None:
            logger.debug("header %s not found under torch/include; Inductor precompiles it",
                         header)
            return real(header, *args, **kwargs)
        return path

    setattr(codecache, name, plain_header)
    try:
        yield
    finally:
        setattr(codecache, name, real)


# ---- Inductor: the vector-ISA build probe --------------------------------------------------

_isa_probe: dict = {"recall": None, "installed": False}  # one machine per process


def remember_isa_build_probes(recall: Callable[[Any, str, Callable], bool]) -> None:
    """Route Inductor's per-ISA build probe (`VecISA.check_build`: compile a test library with
    the ISA's flags, dlopen it in a child) through `recall(isa, code, probe)`, which answers from
    what this machine said before or calls `probe(isa, code)`. The latest `recall` wins."""
    _isa_probe["recall"] = recall
    if _isa_probe["installed"]:
        return
    vec_isa_cls, name, probe = VEC_ISA_CHECK_BUILD.owner_and_value()

    def check_build(isa, code: str) -> bool:
        return _isa_probe["recall"](isa, code, probe)

    setattr(vec_isa_cls, name, check_build)
    _isa_probe["installed"] = True


# ---- Inductor: kernel templates ------------------------------------------------------------

class LazyTemplate:
    """A jinja2 template built from its source on first use (any attribute: render, ...)."""

    __slots__ = ("_build", "_source", "_template")

    def __init__(self, build: Callable[[str], Any], source: str):
        self._build, self._source, self._template = build, source, None

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy/pickle probing a half-made object: not the template's
            raise AttributeError(name)
        if self._template is None:
            self._template = self._build(self._source)
        return getattr(self._template, name)


_lazy_templates: dict = {"installed": False}


def lazy_kernel_templates() -> None:
    """Make Inductor's kernel templates build their jinja2 template when first rendered, not
    when the module defining them is imported (once per process; templates made before stay
    as they are). Without jinja2 Inductor's own None stands."""
    if _lazy_templates["installed"]:
        return
    template_cls, name, build = LAZY_KERNEL_TEMPLATES.owner_and_value()
    has_jinja2 = importlib.util.find_spec("jinja2") is not None

    def lazy(source: str):
        return LazyTemplate(build, source) if has_jinja2 else None

    setattr(template_cls, name, staticmethod(lazy))
    _lazy_templates["installed"] = True


# ---- Dynamo: the cache of backends ---------------------------------------------------------

def forget_backend(backend: Any) -> None:
    """Take `backend` out of Dynamo's `cached_backends`, where torch.compile keeps every backend
    it is given until torch._dynamo.reset(). Kiln's holds the engine's config, and through it
    the model and its KV caches, which would outlive the engine."""
    _, _, cached = DYNAMO_CACHED_BACKENDS.owner_and_value()
    for key, value in list(cached.items()):
        if value is backend or getattr(value, "compiler_fn", None) is backend:
            del cached[key]
