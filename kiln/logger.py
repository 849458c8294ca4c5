"""Kiln's logger: one `kiln` logger tree, configured once, named per module.

Use `init_logger(__name__)` in every module; `KILN_LOGGING_LEVEL` sets the level.
"""
import logging
import sys

from kiln import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger("kiln")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.propagate = False
    _configured = True
    try:
        root.setLevel(envs.logging_level())
    except ValueError as e:  # read at import, before any command could report it
        root.setLevel("INFO")
        root.warning("%s; logging at INFO", e)


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    if not name.startswith("kiln"):
        name = f"kiln.{name}"
    return logging.getLogger(name)
