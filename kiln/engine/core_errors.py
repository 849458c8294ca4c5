"""The errors of an engine core in its own process as the front end raises them: its death, and
the exception it reported (core_messages.failure_report) rebuilt as the same kind where that is
a built-in or Kiln's own."""
import builtins
import importlib

from kiln.core.core_messages import CoreFailed


class EngineCoreDeadError(RuntimeError):
    """The engine core process exited (killed, crashed, or a step failed)."""


def engine_gone(e: BaseException) -> bool:
    """Whether an engine call failed because the engine is gone (its core process, or a rank),
    not because of the request."""
    from kiln.executor.rank_errors import WorkerFailedError

    return isinstance(e, (EngineCoreDeadError, WorkerFailedError))


def error_class(failure: CoreFailed):
    """The class of the core's exception, where it is a built-in or Kiln's own."""
    if failure.error_module == "builtins":
        return getattr(builtins, failure.error_type, None)
    if failure.error_module.startswith("kiln."):
        try:
            return getattr(importlib.import_module(failure.error_module), failure.error_type, None)
        except ImportError:
            return None
    return None


def rebuild_error(failure: CoreFailed) -> BaseException:
    """The core's exception as the same kind where it is a built-in or Kiln's (ValueError stays
    ValueError, WorkerFailedError stays WorkerFailedError), else as an EngineCoreDeadError; the
    message is the core's own."""
    kind = error_class(failure)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not EngineCoreDeadError:
        try:
            return kind(failure.message)
        except Exception:  # noqa: BLE001 - an exception type that wants other arguments
            pass
    return EngineCoreDeadError(f"the engine core failed: {failure.error_type}: "
                               f"{failure.message}")

