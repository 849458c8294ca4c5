"""Keeps the GGUF conversion cache (<cache root>/gguf/) from growing without bound.

A file's conversion (config, tokenizer, tensor table and weight snapshots: about 6.6 times the
GGUF) lives in a folder keyed by the file's identity and the versions that read it
(gguf_metadata.converted_dir). A moved, touched or re-downloaded file, or an upgrade, made a new
folder and the old one stayed forever, as did the temporaries of a load killed while saving (a
weight snapshot's is the model's full size).

Only what no live process can still use goes: the folders converted earlier from the same path
when the file there has changed since (each folder's `source` file names the path and the file's
identity; folders without one are left alone), unless a live writer is at work in one, and
temporaries whose writer process is gone. A folder of the same file made by other versions (of
Kiln, transformers, gguf: another install sharing the cache) stays: it is that install's.
"""
import glob
import shutil
from pathlib import Path

from kiln.atomic_write import abandoned, atomic_write_text
from kiln.logger import init_logger

logger = init_logger(__name__)

_SOURCE = "source"
# How long a dead writer's temporary must have been left untouched before it is removed.
_MIN_AGE_S = 600.0


def claim(folder: Path, gguf: Path) -> None:
    """Make `folder` (`gguf`'s converted folder) and note the file it converts in it; the first
    time, remove the folders converted from that path before the file changed. OSError where
    it cannot write."""
    from kiln.config.hf_config_snapshot import file_identity

    record = folder / _SOURCE
    if record.is_file():
        return
    source = (str(gguf.resolve()), file_identity(gguf.resolve()))
    atomic_write_text(record, "\n".join(source))
    stem = folder.name.rsplit("-", 1)[0]  # converted_dir's "<stem>-<key>": the same path's stem
    for other in folder.parent.glob(f"{glob.escape(stem)}-*"):
        was = _source_of(other)
        if (other != folder and was is not None and was[0] == source[0] and was[1] != source[1]
                and not _in_use(other)):
            shutil.rmtree(other, ignore_errors=True)
            logger.info("removed %s: a conversion of %s before it changed", other, source[0])


def sweep(folder: Path) -> None:
    """Remove the temporaries under `folder` whose writers died before finishing them."""
    for tmp in list(folder.rglob(".*.tmp")):
        if abandoned(tmp, _MIN_AGE_S):
            logger.info("removing %s, left by a process that died while writing it", tmp)
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _source_of(folder: Path) -> tuple[str, str] | None:
    """(path, file identity) a folder converts; None where it does not say both."""
    try:
        lines = (folder / _SOURCE).read_text().split("\n")
    except OSError:  # none (an older Kiln's folder, or not a conversion): not ours to judge
        return None
    return (lines[0], lines[1]) if len(lines) == 2 else None


def _in_use(folder: Path) -> bool:
    """Whether a process may still be writing in `folder`: a temporary not abandoned."""
    return any(not abandoned(tmp, _MIN_AGE_S) for tmp in folder.rglob(".*.tmp"))
