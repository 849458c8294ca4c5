"""Warm-up vs serving: compiling is allowed only while warming up.

The worker calls `end_warmup()` once every shape is compiled; a compile after that is a bug.
"""
import contextlib


class RecompileAfterWarmupError(RuntimeError):
    """Something asked for a (re)compile after warm-up ended; the message names the cause."""


_serving = False


def end_warmup() -> None:
    """Declare warm-up over: from now on every compile raises RecompileAfterWarmupError."""
    global _serving
    _serving = True


def is_serving() -> bool:
    return _serving


def reset_warmup() -> None:
    """Back to warm-up (a new engine in the same process, or tests)."""
    global _serving
    _serving = False


@contextlib.contextmanager
def warming_up():
    """Run a block as warm-up (compiles allowed), restoring the previous phase after."""
    global _serving
    previous, _serving = _serving, False
    try:
        yield
    finally:
        _serving = previous


def check_may_compile(what: str) -> None:
    if _serving:
        raise RecompileAfterWarmupError(
            f"{what} after warm-up ended (kiln.compilation.phase.end_warmup() was called): every "
            "shape must be compiled during warm-up. Add the size to compilation_config."
            "compile_sizes / stay within max_num_batched_tokens, or run with enforce_eager=True.")
