"""Builds Kiln's C kernels (csrc/*.c) into shared libraries at first use and loads them (ctypes),
and its C++ torch ops (csrc/*.cpp) into libraries torch loads (`load_torch_op`).

Cached under Kiln's cache root keyed by the sources, compiler and CPU flags (-march=native), and
torch's version for the C++ ones, each library beside its checksum (checked before it is loaded:
a damaged file is rebuilt, never mapped), built under a lock; None / False, with one warning,
when it cannot be done (KILN_REQUIRE_NATIVE=1: an error).
"""
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kiln import envs
from kiln.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -ffast-math: dot products end in a vector tree instead of 16 scalar adds, and expf vectorizes
# (glibc's libmvec). Safe here: the kernels never produce inf or NaN from finite inputs.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11", "-ffast-math"]
# Linked apart, without -ffast-math: linking with it adds GCC's crtfastmath.o, whose constructor
# sets FTZ/DAZ when the library loads, flushing subnormals to zero in torch's own math too.
LINK_FLAGS = ["-shared", "-fopenmp"]
# The C++ ops only dispatch (their arithmetic is in the C kernels): no -march or fast-math.
CXX_FLAGS = ["-O2", "-fPIC", "-shared"]
# torch dtype -> the kernels' dtype code (csrc/dtype.h).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def compiler() -> str | None:
    """$CC, else cc/gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cxx_compiler() -> str | None:
    """$CXX, else c++/g++ on PATH (the compiler Inductor's CPU code needs too)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _torch_flags() -> list[str]:
    """Compiling and linking against the running torch (its headers, ABI and libraries)."""
    root = Path(torch.__file__).parent
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_cpu", "-lc10"]


def _cpu_flags() -> str:
    # -march=native bakes the CPU in, so a cache shared between machines must not mix builds.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(name: str, cc: str, flags: list[str] = FLAGS) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in (name.encode(), *(p.read_bytes() for p in sorted(CSRC.iterdir())),
                 version.encode(), " ".join(flags).encode(), platform.machine().encode(),
                 _cpu_flags().encode(), torch.__version__.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _checksum_file(library: Path) -> Path:
    return library.parent / (library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(library: Path) -> bool:
    """The library is there and its bytes are those its build recorded (a file truncated or
    altered since, mapped by the loader, would crash the process on first touch: SIGBUS)."""
    try:
        return _checksum_file(library).read_text().strip() == _digest(library)
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


def _flags(cpp: bool) -> list[str]:
    return CXX_FLAGS + _torch_flags() if cpp else FLAGS + LINK_FLAGS


def library_path(name: str, cc: str, cpp: bool = False) -> Path:
    """Where build() keeps csrc/<name>'s library for these sources, compiler and CPU."""
    return envs.cache_root() / "kernels" / build_key(name, cc, _flags(cpp)) / f"libkiln_{name}.so"


def build(name: str, cc: str, cpp: bool = False, rebuild: bool = False) -> Path:
    """csrc/<name>.c (or, cpp, csrc/<name>.cpp against torch) as a shared library in the cache,
    compiled on first use, when its checksum fails, or when `rebuild` (under the key's lock,
    then an atomic rename: a reader sees a whole file or none)."""
    flags = _flags(cpp)
    target = library_path(name, cc, cpp)
    if not rebuild and intact(target):
        return target
    with _build_lock(target.parent):
        if not rebuild and intact(target):  # another process built it meanwhile
            return target
        if target.exists() and not rebuild:
            logger.warning("the cached CPU kernels %s (%s) %s; rebuilding them", name, target,
                           "fail their checksum" if _checksum_file(target).exists()
                           else "have no checksum")
        _compile(name, cc, cpp, flags, target)
    return target


def _compile(name: str, cc: str, cpp: bool, flags: list[str], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-len(".so")] + ".o"
    source = CSRC / f"{name}.{'cpp' if cpp else 'c'}"
    steps = ([[cc, f"-I{CSRC}", str(source), "-o", tmp, *flags, "-lm"]] if cpp else
             [[cc, f"-I{CSRC}", "-c", str(source), "-o", obj, *FLAGS],
              [cc, obj, "-o", tmp, *LINK_FLAGS, "-lm"]])
    try:
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide a shared cache from other users
        digest = _digest(Path(tmp))
        os.replace(tmp, target)
        checksum = _checksum_file(target)
        checksum.with_suffix(".tmp").write_text(digest + "\n")
        os.replace(checksum.with_suffix(".tmp"), checksum)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    logger.info("built the CPU kernels %s: %s", name, target)


def _unavailable(message: str) -> None:
    """The kernels are off: one warning, or under KILN_REQUIRE_NATIVE=1 an error."""
    if envs.require_native():
        raise RuntimeError(f"{message} (KILN_REQUIRE_NATIVE=1 makes this an error)")
    logger.warning("%s", message)


def _open_library(name: str, cc: str, cpp: bool, path: Path, open_fn):
    """open_fn(path), `path` the library build() gave; one that fails to open (a cached file
    truncated, say) is rebuilt once, so a damaged cache does not leave the kernels off for good."""
    try:
        return open_fn(str(path))
    except OSError as first:
        logger.warning("the cached CPU kernels %s do not load (%s); rebuilding them", name, first)
        return open_fn(str(build(name, cc, cpp, rebuild=True)))


@functools.cache
def load(name: str, signatures: tuple[tuple[str, tuple], ...]) -> ctypes.CDLL | None:
    """The library of csrc/<name>.c with each (function, argtypes) declared (restype int: 0 on
    success), or None (with one warning saying why) when it cannot be built."""
    cc = compiler()
    if cc is None:
        _unavailable(f"no C compiler found (set CC or install gcc): the CPU kernels {name} are "
                     "off and the slower torch code runs instead")
        return None
    try:
        lib = _open_library(name, cc, False, build(name, cc), ctypes.CDLL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _unavailable(f"could not build the CPU kernels {name} ({e}); the slower torch code runs "
                     "instead")
        return None
    for fn, argtypes in signatures:
        getattr(lib, fn).argtypes = list(argtypes)
        getattr(lib, fn).restype = ctypes.c_int
    return lib


# C++ op builds by (name, compiler, cache root), started together: a compiler run mostly parses
# torch's headers (~7 s on 2 cores), so the ops' first builds overlap instead of queueing.
_torch_op_builds: dict[tuple[str, str, Path], concurrent.futures.Future] = {}
_torch_op_builds_lock = threading.Lock()


def _torch_op_library(name: str, cxx: str) -> Path:
    """csrc/<name>.cpp's library, built if needed, together with every other C++ op not yet
    asked for; raises what build() raises."""
    root = envs.cache_root()
    with _torch_op_builds_lock:
        if (name, cxx, root) not in _torch_op_builds:
            names = sorted({name, *(p.stem for p in CSRC.glob("*.cpp"))})
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(names))
            for other in names:
                if (other, cxx, root) not in _torch_op_builds:
                    _torch_op_builds[other, cxx, root] = pool.submit(build, other, cxx, True)
            pool.shutdown(wait=False)
    return _torch_op_builds[name, cxx, root].result()


@functools.cache
def load_torch_op(name: str) -> bool:
    """Load csrc/<name>.cpp's torch ops (built on first use); False, with one warning saying
    why, when it cannot be built."""
    cxx = cxx_compiler()
    if cxx is None:
        _unavailable(f"no C++ compiler found (set CXX or install g++): the C++ op {name} is off "
                     "and the slower torch code runs instead")
        return False
    try:
        _open_library(name, cxx, True, _torch_op_library(name, cxx), torch.ops.load_library)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _unavailable(f"could not build the C++ op {name} ({e}); the slower torch code runs "
                     "instead")
        return False
    return True


def check(rc: int, fn: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{fn} failed with code {rc} (1 = bad shapes or indices, "
                           "2 = out of memory)")
