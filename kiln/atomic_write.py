"""`atomic_write_text`: a file replaced whole (a temporary beside it, renamed over it), so a reader
sees the old text or the new one, never a part; for the caches every layer keeps.
`temporary_beside` names such a temporary for writers of other kinds of files, and `abandoned`
tells one whose writer is gone (a process killed while writing), which nothing will finish."""
import os
import re
import threading
import time
from pathlib import Path

# temporary_beside's names: the writer's pid and thread id.
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.(\d+)\.tmp$")


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


def abandoned(path: Path, min_age_s: float) -> bool:
    """Whether `path`, named by `temporary_beside`, was left by a writer no longer alive and
    untouched for `min_age_s`: nothing will finish it. The age covers writers whose pid means
    nothing here (another machine or pid namespace sharing the cache), which keep writing."""
    m = _TEMPORARY.match(path.name)
    if m is None or _alive(int(m.group(1))):
        return False
    try:
        return time.time() - path.stat().st_mtime >= min_age_s
    except OSError:  # gone already
        return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True
