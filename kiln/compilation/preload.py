"""Imports the compile stack (Dynamo, Inductor's compile_fx, Kiln's backend) on a thread while
the engine core loads the model, so warm-up does not wait on about 1.5 s of imports.

The imports hold the GIL, the weight packing does not: the two overlap. `wait()` joins the
thread before the first compile-stack import on the main thread, so no import races another.
"""
import importlib
import threading

from kiln.logger import init_logger

logger = init_logger(__name__)

MODULES = ("torch._dynamo", "torch._inductor.standalone_compile", "torch._inductor.compile_fx",
           "kiln.compilation.backend")

_thread: threading.Thread | None = None


def _import() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the main thread's own import reports it
            logger.debug("preloading %s failed: %s", name, e)
            return


def start() -> None:
    """Begin the imports on a thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_import, name="kiln-compile-preload", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once a started preload is done (at once if none was started)."""
    if _thread is not None:
        _thread.join()
