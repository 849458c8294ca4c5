"""Loading saved CPU artifacts without Inductor's precompiled header, which only compiles need.

Before it loads a CPU kernel library, even one already built, Inductor looks up its precompiled
kernel header: it runs the C++ preprocessor over the header to hash it (~0.2 s per process) and,
when the 156 MB `.gch` is missing from its temp dir (a new machine or container, a cleared /tmp),
builds it (~6 s on 2 cores) -- a warm start ran the C++ compiler for a file it never used. While
Kiln loads artifacts, Inductor gets the header itself instead: nothing runs, and a library that
is missing after all still builds, correctly, only without the precompiled speed-up.
"""
import contextlib
from pathlib import Path

import torch

from kiln.logger import init_logger

logger = init_logger(__name__)


def plain_header_path(header: str) -> str | None:
    """The header as torch ships it (`torch/include/<header>`), or None if this torch lacks it."""
    path = Path(torch.__file__).parent / "include" / header
    return str(path) if path.is_file() else None


@contextlib.contextmanager
def headers_not_precompiled():
    """Within the block, Inductor's precompiled-header lookup returns the plain header.

    Inductor only passes the path to the compiler (`-include <path>`), which uses a `.gch` beside
    it when there is one and the header's text otherwise, so the build is the same either way.
    The lookup is a module global of Inductor's codecache: the block is not thread-safe, which
    suits loads (Kiln loads on the thread that builds the model).
    """
    from torch._inductor import codecache

    real = getattr(codecache, "_precompile_header", None)
    if real is None:  # a torch that does not precompile headers: nothing to skip
        yield
        return

    def plain_header(header: str, *args, **kwargs) -> str:
        path = plain_header_path(header)
        if path is None:
            logger.debug("header %s not found under torch/include; Inductor precompiles it",
                         header)
            return real(header, *args, **kwargs)
        return path

    codecache._precompile_header = plain_header
    try:
        yield
    finally:
        codecache._precompile_header = real
