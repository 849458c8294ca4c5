"""`atomic_write_text`: a file replaced whole (a temporary beside it, renamed over it), so a reader
sees the old text or the new one, never a part; for the caches every layer keeps."""
import os
import threading
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` (its folders made) atomically; nothing is left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temporary per writer: processes and threads may write the same file at once
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
