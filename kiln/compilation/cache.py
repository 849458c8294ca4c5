"""The on-disk compile cache: its key, its directory layout, and its index of artifacts.

<cache_root>/torch_compile_cache/<key>/<rank dir>/<prefix>/{index.json, split_graph.py, artifacts/}
where the rank dir is rank_<r>, or rank_<r>_stage_<s> under pipeline parallelism
with Inductor's own cache at <key>/inductor_cache (set around each compile and load, see
`inductor_cache_at`), so a warm start runs no C++ compiler.
"""
import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln import envs
from kiln.atomic_write import atomic_write_text
from kiln.logger import init_logger
from kiln.version import __version__

logger = init_logger(__name__)

# The running checkout: a saved trace names its traced files by absolute path, so another
# checkout sharing the cache would otherwise hash the first one's files and load its code.
KILN_ROOT = str(Path(__file__).resolve().parents[1])


# Kiln's own compile stack (splitting, piecewise assembly, the saved-graph format) decides what a
# cached model is without being traced: an edit there in a checkout must not load old artifacts.
STACK_CODE_DIRS = ("compilation", "compilation/warm_start")


def code_hash(root: Path, directories: tuple[str, ...]) -> str:
    """A hash of every .py file directly under each of `root`'s `directories`, names and
    contents."""
    h = hashlib.sha256()
    for directory in directories:
        for path in sorted((root / directory).glob("*.py")):
            h.update(f"{directory}/{path.name}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def stack_code_hash() -> str:
    return code_hash(Path(KILN_ROOT), STACK_CODE_DIRS)


def source_hash(files: list[str]) -> str:
    """Hash of the contents of the traced source files (missing files hash by name)."""
    h = hashlib.sha256()
    for name in sorted(set(files)):
        h.update(name.encode())
        try:
            h.update(Path(name).read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def compute_cache_key(config_hash: str, traced_files: list[str], compiler_hash: str,
                      device: str) -> str:
    """The cache key; pure, so tests can check what changes it."""
    factors = [__version__, KILN_ROOT, stack_code_hash(), config_hash, source_hash(traced_files),
               compiler_hash, torch.__version__, device, platform.machine(), sys.version_info[:2]]
    return hashlib.sha256(repr(factors).encode()).hexdigest()[:16]


def compiled_graph_key(kiln_config, compiler, traced_files: list[str]) -> str:
    """The cache key of a model compiled under `kiln_config` by `compiler` from those sources."""
    return compute_cache_key(kiln_config.compute_hash(), traced_files, compiler.compute_hash(),
                             kiln_config.device_config.device)


def cache_base_dir(configured: str) -> Path:
    return Path(configured).expanduser() if configured else (
        envs.cache_root() / "torch_compile_cache")


@functools.cache
def private_inductor_cache_dir() -> Path:
    """An Inductor cache for this process alone, removed at exit: with Kiln's cache disabled,
    Inductor's global one would still serve what earlier processes compiled."""
    path = Path(tempfile.mkdtemp(prefix="kiln_inductor_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def remove_private_inductor_cache() -> None:
    """Remove this process's private Inductor cache now, if it made one: for a process that ends
    in os._exit (the engine core), which runs no atexit handler."""
    if private_inductor_cache_dir.cache_info().currsize:
        shutil.rmtree(private_inductor_cache_dir(), ignore_errors=True)


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Set by Inductor itself before it loads each C++ kernel library (which reads it at import).
_INDUCTOR_WRITES = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",)


@contextlib.contextmanager
def inductor_cache_at(path: Path | None):
    """Inductor's cache at `path` within the block (None: wherever the process has it), and the
    process's environment as it was afterwards. Inductor takes its cache directory from this
    environment variable only, and writes variables itself (the directory once it looked, a
    pointer for each kernel library it loads), so they are set around each compile and load
    and restored: no engine leaves its settings to the process or to other engines."""
    names = (INDUCTOR_CACHE_ENV, *_INDUCTOR_WRITES)
    before = {name: os.environ.get(name) for name in names}
    if path is not None:
        os.environ[INDUCTOR_CACHE_ENV] = str(path)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def index_key(shape: int | None, piece: int, compiler: str, fingerprint: str) -> str:
    """One entry per piece graph: two builds under one cache key whose pieces differ (dummy and
    real weights laid out apart, say) keep each other's entries instead of evicting them."""
    return f"{'range' if shape is None else shape}/piece_{piece}/{compiler}/{fingerprint}"


def rank_dir_name(rank: int, pipeline_parallel_size: int, pp_rank: int) -> str:
    """A rank's directory under a cache key: each rank compiles its own part of the model, and
    under pipeline parallelism the name says which stage's layers it holds."""
    return f"rank_{rank}" if pipeline_parallel_size == 1 else f"rank_{rank}_stage_{pp_rank}"


def rank_dir_of(parallel_config) -> str:
    pc = parallel_config
    return rank_dir_name(pc.rank, pc.pipeline_parallel_size, pc.pp_rank)


# How long a compiled library must have been left alone before a cut-short one is removed:
# a link writes its output in seconds at most.
_SETTLED_S = 10.0


def elf_complete(head: bytes, size: int) -> bool:
    """Whether a 64-bit little-endian ELF file of `size` bytes, starting with `head` (its first
    64 bytes), holds its whole section header table (the last thing a linker writes)."""
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return False
    shoff = int.from_bytes(head[0x28:0x30], "little")
    shentsize = int.from_bytes(head[0x3A:0x3C], "little")
    shnum = int.from_bytes(head[0x3C:0x3E], "little")
    return shoff + shentsize * shnum <= size


class CompileCache:
    """One (key, rank, prefix) directory: the index of saved artifacts and the artifacts."""

    def __init__(self, key_dir: Path, rank_dir: str, prefix: str):
        self.key_dir = key_dir
        self.dir = key_dir / rank_dir / prefix
        self.artifact_dir = self.dir / "artifacts"
        self.index_path = self.dir / "index.json"
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        self.index = self._read_index()
        self.was_warm = bool(self.index)

    @property
    def inductor_cache_dir(self) -> Path:
        return self.key_dir / "inductor_cache"

    def check_writable(self) -> None:
        """Raise OSError unless artifacts, the index and Inductor's cache can be written here
        (loading an artifact writes too: Inductor unpacks it into its cache), and Inductor can
        build there: its C++ command line is split on whitespace."""
        if any(c.isspace() for c in str(self.inductor_cache_dir)):
            raise OSError(f"Inductor cannot build in a path with whitespace "
                          f"({self.inductor_cache_dir})")
        for directory in (self.dir, self.inductor_cache_dir):
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write_probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()

    def drop_cut_libraries(self, settled_s: float = _SETTLED_S) -> list[Path]:
        """Delete Inductor's compiled libraries that end before their ELF section headers (a
        link cut short: its compiler writes the .so in place, and Inductor reuses any file
        there); loading one killed the process with SIGBUS on every start. Inductor builds
        them again. Files younger than `settled_s` may still be being written: left alone."""
        dropped = []
        now = time.time()
        for path in self.inductor_cache_dir.glob("*/*.so"):
            try:
                stat = path.stat()
                with open(path, "rb") as f:
                    head = f.read(64)
                if now - stat.st_mtime < settled_s or elf_complete(head, stat.st_size):
                    continue
                path.unlink()
            except OSError:
                continue
            dropped.append(path)
            logger.warning("compiled library %s is cut short (%d bytes); removed, to be built "
                           "again", path, stat.st_size)
        return dropped

    def clear_inductor_cache(self) -> None:
        """Remove Inductor's cache under the key (it is rebuilt by compiling); Inductor's
        in-process memo of loaded modules goes too, so nothing is read from the old files."""
        from torch._inductor.codecache import PyCodeCache

        shutil.rmtree(self.inductor_cache_dir, ignore_errors=True)
        PyCodeCache.cache_clear()

    def _read_index(self) -> dict:
        try:
            index = json.loads(self.index_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("compile cache index %s unreadable (%s); starting it afresh",
                           self.index_path, e)
            return {}
        if not isinstance(index, dict):
            logger.warning("compile cache index %s is not a JSON object; starting it afresh",
                           self.index_path)
            return {}
        return index

    def lookup(self, shape: int | None, piece: int, compiler: str,
               fingerprint: str) -> dict | None:
        entry = self.index.get(index_key(shape, piece, compiler, fingerprint))
        # an entry of another shape (a hand-edited or damaged index) is no artifact
        return entry if isinstance(entry, dict) and isinstance(entry.get("file"), str) else None

    def artifact_path(self, name: str) -> Path:
        return self.artifact_dir / name

    def record(self, shape: int | None, piece: int, compiler: str, handle: dict) -> None:
        """Add an entry, merging with what other processes wrote meanwhile (under a file lock)."""
        self.index[index_key(shape, piece, compiler, handle["fingerprint"])] = handle
        with self._writing(self.index_path):
            with self.locked():
                on_disk = self._read_index()
                on_disk.update(self.index)
                self.index = on_disk
                atomic_write_text(self.index_path, json.dumps(on_disk, indent=1, sort_keys=True))

    def forget(self, shape: int | None, piece: int, compiler: str, fingerprint: str) -> None:
        """Drop a damaged entry here and on disk, so the next `record`'s merge does not
        bring it back (another process may have written a good one meanwhile: kept)."""
        key = index_key(shape, piece, compiler, fingerprint)
        bad = self.index.pop(key, None)
        with self._writing(self.index_path), self.locked():
            on_disk = self._read_index()
            if bad is None or on_disk.get(key) != bad:
                return
            del on_disk[key]
            atomic_write_text(self.index_path, json.dumps(on_disk, indent=1, sort_keys=True))

    def write_text(self, name: str, text: str) -> None:
        with self._writing(self.dir / name):
            atomic_write_text(self.dir / name, text)

    @staticmethod
    @contextlib.contextmanager
    def _writing(path: Path):
        """The cache's bookkeeping is best effort, as saving an artifact is: a file it cannot
        write (a full disk, a directory or an immutable file in its place) costs a compile at
        the next start, never this one."""
        try:
            yield
        except OSError as e:
            logger.warning("compile cache: could not write %s (%s); serving on, and the next "
                           "start may compile again", path, e)

    @contextlib.contextmanager
    def locked(self):
        """The cache directory's lock (index updates; the saved graph and its plan)."""
        with open(self.dir / "index.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
