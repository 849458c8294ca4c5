"""Builds all of Kiln's CPU kernels (csrc/*.c, *.cpp) into one library of torch ops (`torch.ops.kiln.*`)
with torch.utils.cpp_extension (ninja), at first use, and loads it once per process.

Cached under Kiln's cache root keyed by the sources, flags, compiler, CPU and torch, the library
beside its checksum (checked before it is loaded: a damaged file is rebuilt, never mapped),
built under a lock; `available()` False, with one warning, when it cannot be done
(KILN_REQUIRE_NATIVE=1: an error).
"""
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kiln import envs
from kiln.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
NAME = "kiln_native"
# Compile flags only: cpp_extension links with its own flags and `LDFLAGS`, never these. So
# -ffast-math (dot products end in a vector tree instead of 16 scalar adds, expf vectorizes;
# safe here: the kernels produce inf or NaN from finite inputs only past float32 overflow) stays
# off the link, where GCC would add crtfastmath.o, whose constructor sets FTZ/DAZ when the
# library loads, flushing subnormals to zero in torch's own math too.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]

# __FILE__ (in the registration and error messages) names Kiln's sources and torch's headers
# from their packages, not from the checkout or virtual environment, so that the library a key
# names is the same whichever checkout built it.
PATH_FLAGS = ["-fmacro-prefix-map={csrc}/=kiln/native/csrc/", "-fmacro-prefix-map={torch}/=torch/"]
# torch dtype -> the kernels' dtype code (csrc/dtype.h).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cflags() -> list[str]:
    """CFLAGS, then `KILN_NATIVE_CFLAGS` (a lower CPU's tier on this one: `-mno-...`)."""
    return CFLAGS + envs.native_cflags()


# The build, run in a child process: cpp_extension.load builds and loads at once, and this
# process must load only a library whose checksum it has checked (and loads it once: a
# library's ops register once per process).
_BUILD_SCRIPT = """
import json, sys
from torch.utils import cpp_extension
args = json.loads(sys.argv[1])
cpp_extension.load(name=args["name"], sources=args["sources"], extra_cflags=args["cflags"],
                   extra_ldflags=args["ldflags"], extra_include_paths=[args["include"]],
                   build_directory=args["build_directory"], is_python_module=False,
                   verbose=False)
"""


def compiler() -> str | None:
    """$CXX, else c++/g++ on PATH (the compiler Inductor's CPU code needs too)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".cpp"))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") else set()


def _cpu_flags() -> str:
    # -march=native bakes the CPU in, so a cache shared between machines must not mix builds.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def sources_digest() -> str:
    """sha256 of every source and header (names and bytes): what the library is built from,
    its op schemas included."""
    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def build_key(cxx: str) -> str:
    """Hash of the sources (`sources_digest`), the compiler's version, the flags, the CPU and
    torch."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except OSError as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    h = hashlib.sha256()
    for part in (NAME.encode(), sources_digest().encode(),
                 version.encode(), " ".join(cflags() + PATH_FLAGS + ["|"] + LDFLAGS).encode(),
                 platform.machine().encode(), _cpu_flags().encode(), torch.__version__.encode(),
                 str(torch.compiled_with_cxx11_abi()).encode(), sys.version.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_path(cxx: str) -> Path:
    """Where build() keeps the library for these sources, compiler and CPU."""
    return envs.cache_root() / "kernels" / build_key(cxx) / f"{NAME}.so"


def _checksum_file(library: Path) -> Path:
    return library.parent / (library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(library: Path) -> bool:
    """The library is there and its bytes are those its build recorded (a file truncated or
    altered since, mapped by the loader, would crash the process on first touch: SIGBUS)."""
    try:
        # bytes, not text: a checksum file of garbage (non-UTF-8) is a mismatch, not a crash
        return _checksum_file(library).read_bytes().strip() == _digest(library).encode()
    except OSError:
        return False


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build of a key at a time, across threads and processes."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Set by a process that loaded the library, read by the processes it starts (engine core, ranks):
# a child whose KILN_CACHE_ROOT differs (a test's or a user's own) loads its parent's copy of the
# same build instead of compiling the whole library again, minutes on a few cores.
INHERITED_LIBRARY_ENV = "KILN_NATIVE_LIBRARY"


def inherited_library(cxx: str) -> Path | None:
    """The library the parent process loaded, when it is this build (same key) and intact."""
    path = os.environ.get(INHERITED_LIBRARY_ENV)
    if not path:
        return None
    library = Path(path)
    return library if library.parent.name == build_key(cxx) and intact(library) else None


def build(cxx: str, rebuild: bool = False) -> Path:
    """The library in the cache, compiled on first use, when its checksum fails, or when
    `rebuild` (under the key's lock, then an atomic rename: a reader sees a whole file or
    none); the parent process's copy of this build when there is one. Raises RuntimeError (the
    compiler's error) when the build fails."""
    if not rebuild and (inherited := inherited_library(cxx)) is not None:
        return inherited
    target = library_path(cxx)
    if not rebuild and intact(target):
        return target
    with _build_lock(target.parent):
        if not rebuild and intact(target):  # another process built it meanwhile
            return target
        if target.exists() and not rebuild:
            logger.warning("the cached CPU kernels (%s) %s; rebuilding them", target,
                           "fail their checksum" if _checksum_file(target).exists()
                           else "have no checksum")
        _compile(cxx, target)
    return target


def _ninja_path() -> str:
    """PATH with the `ninja` package's binary and this Python's scripts first (cpp_extension runs
    `ninja` from PATH; a virtual environment's bin is not on it when its Python runs directly)."""
    extra = [str(Path(sys.executable).parent)]
    with contextlib.suppress(ImportError, AttributeError):
        import ninja

        extra.insert(0, str(ninja.BIN_DIR))
    return os.pathsep.join([*extra, os.environ.get("PATH", "")])


def _compile(cxx: str, target: Path) -> None:
    # Under the key's lock no other build of it runs: any folder left is a killed build's.
    for stale in target.parent.glob("build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        torch_dir = Path(torch.__file__).parent
        flags = cflags() + [flag.format(csrc=CSRC, torch=torch_dir) for flag in PATH_FLAGS]
        args = {"name": NAME, "sources": [str(p) for p in sources()], "cflags": flags,
                "ldflags": LDFLAGS, "include": str(CSRC), "build_directory": str(work)}
        env = {**os.environ, "CXX": cxx, "PATH": _ninja_path(),
               "MAX_JOBS": os.environ.get("MAX_JOBS", str(max(1, min(4, os.cpu_count() or 1))))}
        env.pop("TORCH_EXTENSIONS_DIR", None)
        proc = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(args)],
                              capture_output=True, text=True, env=env, timeout=3600)
        built = work / f"{NAME}.so"
        if proc.returncode != 0 or not built.exists():
            raise RuntimeError(f"{cxx} failed: {_build_error(proc.stderr or proc.stdout)}")
        tmp = target.parent / f".{NAME}.so.tmp"
        shutil.copyfile(built, tmp)
        os.chmod(tmp, 0o755)  # a shared cache: other users' loaders read it
        digest = _digest(tmp)
        os.replace(tmp, target)
        checksum = _checksum_file(target)
        checksum.with_suffix(".tmp").write_text(digest + "\n")
        os.replace(checksum.with_suffix(".tmp"), checksum)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("built Kiln's CPU kernels: %s", target)


def _build_error(output: str) -> str:
    """The build's own error out of the child's traceback (ninja's output, the compiler's)."""
    start = output.rfind("Error building extension")
    return (output[start:] if start >= 0 else output).strip()[-2000:]


def _unavailable(message: str) -> None:
    """The kernels are off: one warning, or under KILN_REQUIRE_NATIVE=1 an error."""
    if envs.require_native():
        raise RuntimeError(f"{message} (KILN_REQUIRE_NATIVE=1 makes this an error)")
    logger.warning("%s", message)


# The library this process loaded (a library's ops register once per process: a second copy,
# from another cache root, is never loaded), and what runs once it is.
_loaded: Path | None = None
_on_load: list[Callable[[], None]] = []


def loaded_key() -> str | None:
    """The loaded library's build key (`build_key`: its sources, compiler, flags, CPU and
    torch), None when none is loaded."""
    return None if _loaded is None else _loaded.parent.name


def on_load(fn: Callable[[], None]) -> None:
    """Run fn once the library is loaded (at once if it is): the Python fakes of its ops."""
    _on_load.append(fn)
    if _loaded is not None:
        fn()


def _load(path: Path, cxx: str) -> None:
    global _loaded
    if _loaded is not None:
        return
    try:
        torch.ops.load_library(str(path))
    except OSError as first:  # intact, yet it does not load: build it again, once
        logger.warning("the cached CPU kernels do not load (%s); rebuilding them", first)
        path = build(cxx, rebuild=True)
        torch.ops.load_library(str(path))
    _loaded = path
    os.environ[INHERITED_LIBRARY_ENV] = str(path)
    for fn in _on_load:
        fn()


@functools.cache
def available() -> bool:
    """The library built (if needed) and loaded: its ops are `torch.ops.kiln.*`. False, with one
    warning saying why, when it cannot be built."""
    cxx = compiler()
    if cxx is None:
        _unavailable("no C++ compiler found (set CXX or install g++): Kiln's CPU kernels are "
                     "off and the slower torch code runs instead")
        return False
    try:
        _load(build(cxx), cxx)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _unavailable(f"could not build Kiln's CPU kernels ({e}); the slower torch code runs "
                     "instead")
        return False
    return True
