"""Compilers behind one contract: compile a piece for a shape, save it, load it back.

`InductorStandaloneAdaptor` uses torch._inductor.standalone_compile; `EagerAdaptor` runs the
piece's FX graph as is (debugging, and measuring what compiling buys).
"""
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.compilation import vec_isa
from kiln.compilation.artifact_call import direct_callable
from kiln.compilation.counters import compilation_counter
from kiln.compilation.inductor_patches import headers_not_precompiled, lazy_kernel_templates
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

Handle = dict  # JSON-able description of a saved artifact, stored in the cache index


class CompilerInterface:
    name: str = ""

    def compute_hash(self) -> str:
        """Hash of everything about the compiler that changes its output."""
        raise NotImplementedError

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any], config: dict[str, Any],
                shape: int | None, save_path: Path | None = None) -> tuple[Callable, Handle | None]:
        """Compile `graph` for `shape` (None: the dynamic range). With `save_path`, also write
        the artifact there (atomically) and return a handle to it."""
        raise NotImplementedError

    def load(self, handle: Handle, path: Path, graph: fx.GraphModule,
             config: dict[str, Any] | None = None) -> Callable:
        """Rebuild the callable a previous compile saved at `path`, under the `config` it was
        compiled with."""
        raise NotImplementedError


class EagerAdaptor(CompilerInterface):
    name = "eager"

    def compute_hash(self) -> str:
        return hashlib.sha256(b"eager").hexdigest()[:16]

    def compile(self, graph, example_inputs, config, shape, save_path=None):
        return graph, None  # nothing to save: the graph itself is the "artifact"

    def load(self, handle, path, graph, config=None):
        return graph


def inductor_config_hash() -> str:
    from torch._inductor import config as inductor_config

    from kiln.compilation.torch_source_key import torch_source_key

    factors = [torch.__version__, torch_source_key(), repr(sorted(
        (k, v) for k, v in inductor_config.save_config_portable().items()
        if not k.startswith("post_grad_custom")))]
    return hashlib.sha256(repr(factors).encode()).hexdigest()[:16]


def cpu_threads_factor() -> tuple[int, int]:
    """What Inductor's CPU code bakes in from the thread pool: with fewer threads than the
    machine's CPUs it writes `omp parallel num_threads(n)` and parallelises fewer loop levels.
    Code compiled under OMP_NUM_THREADS=1 would run on one thread forever after."""
    return torch.get_num_threads(), os.cpu_count() or 1


def cpu_vec_isa_factor() -> str:
    """The vector ISA Inductor writes CPU kernels for here (the CPU's, or lower under
    ATEN_CPU_CAPABILITY): AVX-512 code loaded where AVX2 is picked computed NaNs."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return f"{isa}|{isa.build_arch_flags() if isa else ''}"


class InductorStandaloneAdaptor(CompilerInterface):
    name = "inductor_standalone"

    def __init__(self, pass_manager=None, device: str = "cpu"):
        from kiln.platforms import for_device

        self.pass_manager = pass_manager
        self.device = device
        self.defaults = dict(for_device(device).inductor_compile_defaults)
        self.dump_dir: Path | None = None  # set by the backend when debug_dump_path is given
        self._dumps = 0  # output codes dumped: names the pieces of a run that saves none
        lazy_kernel_templates()  # before a compile or load imports Inductor's lowerings

    def compute_hash(self) -> str:
        if self.device == "cpu":
            vec_isa.settle()  # may set an Inductor flag: before hashing Inductor's config
        uuid = ""
        if self.pass_manager is not None:
            self.pass_manager.set_shape(None)
            uuid = self.pass_manager.uuid()
        factors = f"{inductor_config_hash()}|{uuid}|{sorted(self.defaults.items())}"
        if self.device == "cpu":
            factors += f"|{cpu_threads_factor()}|{cpu_vec_isa_factor()}"
        return hashlib.sha256(factors.encode()).hexdigest()[:16]

    def config_patches(self, config: dict[str, Any]) -> dict[str, Any]:
        """The platform's defaults where this torch has the option, under the user's values."""
        from torch._inductor import config as inductor_config

        patches = {k: v for k, v in self.defaults.items() if hasattr(inductor_config, k)}
        patches.update(config)
        return patches

    def compile(self, graph, example_inputs, config, shape, save_path=None):
        patches = self.config_patches(config)
        if self.pass_manager is not None:
            self.pass_manager.set_shape(shape)
            patches["post_grad_custom_pre_pass"] = self.pass_manager
        dynamic = "from_tracing_context" if shape is None else "from_example_inputs"
        from torch._inductor.codecache import PyCodeCache

        known_modules = len(PyCodeCache.modules)
        runs = len(self.pass_manager.runs) if self.pass_manager is not None else 0
        try:
            artifact = torch._inductor.standalone_compile(
                graph, example_inputs, dynamic_shapes=dynamic,
                options={"config_patches": patches})
        except BaseException:
            if self.pass_manager is not None:
                self.pass_manager.forget_runs_since(runs)
            raise
        compilation_counter.num_inductor_compiles += 1
        if self.dump_dir is not None:
            self._dump_output_code(PyCodeCache.modules[known_modules:], shape, save_path)
        handle = None
        if save_path is not None:
            try:
                handle = self._save(artifact, save_path)
            except Exception as e:  # noqa: BLE001 - serve the compiled piece all the same
                logger.warning("compiled artifact %s could not be saved (%s: %s); the next start "
                               "compiles it again", save_path, type(e).__name__, e)
            else:
                # Served as loaded, like a warm start's: the loaded form's call can skip the
                # runtime wrapper (artifact_call.py), the fresh one's is built differently.
                artifact = self._load_under(config, save_path.with_name(handle["file"]),
                                            "binary")
        return direct_callable(artifact), handle

    @staticmethod
    def _save(artifact, save_path: Path) -> dict:
        """Write the artifact atomically under a content-addressed name; its index handle."""
        save_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = save_path.with_name(f".{save_path.name}.{os.getpid()}.tmp")
        try:
            artifact.save(path=str(tmp), format="binary")
            digest = file_sha256(tmp)
            # Content-addressed name: two processes compiling the same piece write different
            # bytes, and each index entry must keep naming the file whose checksum it holds.
            save_path = save_path.with_name(f"{save_path.stem}_{digest[:12]}{save_path.suffix}")
            os.replace(tmp, save_path)  # atomic: readers see a whole file or none
        finally:
            tmp.unlink(missing_ok=True)
        compilation_counter.num_compiled_artifacts_saved += 1
        return {"file": save_path.name, "sha256": digest, "format": "binary"}

    def _dump_output_code(self, modules, shape, save_path) -> None:
        """Write the Python module(s) Inductor generated for this compile (its output code)."""
        # Without a save path every piece of one shape would take the same name.
        stem = save_path.stem if save_path is not None else f"shape_{shape}_{self._dumps}"
        self._dumps += 1
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        for i, module in enumerate(modules):
            source = getattr(module, "__file__", None)
            if source and os.path.exists(source):
                (self.dump_dir / f"output_code_{stem}_{i}.py").write_text(Path(source).read_text())

    def load(self, handle, path, graph, config=None):
        if file_sha256(path) != handle["sha256"]:
            raise ValueError(f"compiled artifact {path} does not match its recorded checksum "
                             "(truncated or corrupted)")
        from torch._inductor.codecache import PyCodeCache

        known_modules = len(PyCodeCache.modules)
        artifact = self._load_under(config or {}, path, handle["format"])
        compilation_counter.num_compiled_artifacts_loaded += 1
        if self.dump_dir is not None:
            self._dump_output_code(PyCodeCache.modules[known_modules:], None, path)
        return direct_callable(artifact)

    def _load_under(self, config: dict[str, Any], path: Path, fmt: str):
        """Load an artifact under the options it was compiled with. Loading builds its C++
        kernels again where Inductor's cache lacks them, with flags from Inductor's config:
        under the process's (cpp.simdlen unset: AVX-512) the AVX2 code a user's
        {"cpp.simdlen": 256} generated was built for AVX-512 vectors, and wrote past its
        buffers (a heap corruption abort at the first forward)."""
        from torch._inductor import config as inductor_config

        with inductor_config.patch(self.config_patches(config)):
            return _load_artifact(path, fmt)


def _load_artifact(path: Path, fmt: str):
    with headers_not_precompiled():  # its libraries are built: no compiler run needed
        return torch._inductor.CompiledArtifact.load(path=str(path), format=fmt)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_compiler(backend: str, pass_manager=None, device: str = "cpu") -> CompilerInterface:
    if backend == "eager":
        return EagerAdaptor()
    if backend == "inductor":
        return InductorStandaloneAdaptor(pass_manager, device)
    raise ConfigError(f"compilation_config.backend must be 'inductor' or 'eager'; got {backend!r}")
