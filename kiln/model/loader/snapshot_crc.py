"""The CRC that names a weight snapshot: computed over the whole file, read back from the name,
and checked on a thread (`Check`) while the restored weights are packed."""
import threading
import zlib
from pathlib import Path
from typing import BinaryIO


def file_crc(f: BinaryIO) -> int:
    """CRC-32 of an open file's every byte (a snapshot's header, its manifest and tensor
    offsets, and its data)."""
    f.seek(0)
    crc = 0
    while chunk := f.read(1 << 24):
        crc = zlib.crc32(chunk, crc)  # releases the GIL: runs beside the packing
    return crc


def find(path: Path) -> tuple[Path, int] | None:
    """The saved snapshot for `path` (its name carries the CRC) and that CRC, if any."""
    for p in path.parent.glob(f"{path.stem}-*{path.suffix}"):
        try:
            return p, int(p.stem.rsplit("-", 1)[1], 16)
        except ValueError:
            continue
    return None


class Check:
    """The CRC of a mapped snapshot, computed on a thread from the file as it was opened (a
    racing prune may unlink it meanwhile); `passed()` waits for it."""

    def __init__(self, path: Path, handle: BinaryIO, expected: int):
        self.path, self.expected = path, expected
        self._crc: int | None = None
        self._thread = threading.Thread(target=self._run, args=(handle,),
                                        name="kiln-weight-crc", daemon=True)
        self._thread.start()

    def _run(self, handle: BinaryIO) -> None:
        with handle:
            try:
                self._crc = file_crc(handle)
            except OSError:  # unreadable: not trusted
                self._crc = None

    def passed(self) -> bool:
        self._thread.join()
        return self._crc == self.expected
