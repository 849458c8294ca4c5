"""Inductor's `torch_key()` (a sha256 of every torch source file, part of the compile cache key)
kept on disk, reused while no torch source file changed size or modification time.

Hashing the 2,285 files took 0.07-0.14 s of every start on 2 cores; listing their sizes and
times takes 0.013 s.
"""
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from kiln import envs
from kiln.atomic_write import atomic_write_text
from kiln.logger import init_logger

logger = init_logger(__name__)


def source_signature(root: Path, version: str) -> str:
    """Path, size and mtime of every .py file of the package at `root` and its subpackages (the
    files torch_key reads: pkgutil finds modules in directories with an __init__.py)."""
    h = hashlib.sha256(f"{version}\0{root}\n".encode())
    stack = [str(root)]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    if os.path.exists(os.path.join(entry.path, "__init__.py")):
                        stack.append(entry.path)
                elif entry.name.endswith(".py"):
                    st = entry.stat()
                    h.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cached_key(compute: Callable[[], bytes], signature: str, cache_file: Path) -> bytes:
    """`compute()`'s value as recorded in `cache_file` under `signature`, else computed and
    recorded (a damaged or stale record is recomputed; an unwritable one only logged)."""
    try:
        record = json.loads(cache_file.read_text())
        if record["signature"] == signature:
            return bytes.fromhex(record["key"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = compute()
    try:
        atomic_write_text(cache_file, json.dumps({"signature": signature, "key": key.hex()}))
    except OSError as e:
        logger.debug("torch source key not cached in %s (%s)", cache_file, e)
    return key


_memo: dict[str, bytes] = {}  # per process: its torch's sources are the ones imported


def torch_source_key() -> bytes:
    """torch_key(), from Kiln's cache when torch's sources are unchanged since it was computed;
    torch's own memo is given the value, so Inductor's later calls reuse it."""
    import torch
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    torch_key = codecache.torch_key
    if envs.disable_compile_cache() or inductor_config.is_fbcode():
        return torch_key()
    if "key" not in _memo:  # each start hashes the compiler twice (entry path, cache key)
        _memo["key"] = _recorded_torch_key(torch, torch_key)
    return _memo["key"]


def _recorded_torch_key(torch, torch_key) -> bytes:
    """The value from disk (or computed and recorded), handed to torch's memo."""
    root = Path(torch.__file__).parent
    name = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    key = cached_key(torch_key, source_signature(root, torch.__version__),
                     envs.cache_root() / "torch_source_key" / f"{name}.json")
    setter = getattr(torch_key, "set", None)  # torch's prefetchable cache
    if setter is not None:
        try:
            setter(key)
        # Already computed in this process: that value is the truth. torch 2.13 raises
        # RuntimeError here, torch 2.11 fails an assert.
        except (RuntimeError, AssertionError):
            return torch_key()
    return key
