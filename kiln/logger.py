"""Kiln's logger: one `kiln` logger tree, configured once, named per module.

Use `init_logger(__name__)` in every module; `KILN_LOGGING_LEVEL` sets the level,
`KILN_LOGGING_PREFIX` a prefix, and `KILN_CONFIGURE_LOGGING=0` leaves it all to the application
(vLLM's VLLM_LOGGING_LEVEL, VLLM_LOGGING_PREFIX and VLLM_CONFIGURE_LOGGING, where Kiln's are unset).
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
    _configured = True
    try:
        if not envs.configure_logging():  # the application's handlers and levels apply
            return
        level, error = envs.logging_level(), None
    except ValueError as e:  # read at import, before any command could report it
        level, error = "INFO", e
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = envs.logging_prefix().replace("%", "%%")  # a literal, not a format field
        handler.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.propagate = False
    root.setLevel(level)
    if error is not None:
        root.warning("%s; logging at INFO", error)


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    if not name.startswith("kiln"):
        name = f"kiln.{name}"
    return logging.getLogger(name)
