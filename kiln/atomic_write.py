"""`atomic_write_text`: a file replaced whole (a temporary beside it, renamed over it), so a reader
sees the old text or the new one, never a part; for the caches every layer keeps.
`temporary_beside` names such a temporary for writers of other kinds of files."""
import os
import threading
from pathlib import Path


def temporary_beside(path: Path) -> Path:
    """A hidden temporary name beside `path`, one per writer: processes and threads may write
    the same file at once."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` (its folders made) atomically; nothing is left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
