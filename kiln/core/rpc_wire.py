"""collective_rpc across processes: the call and its results pickled (tensors and a callable by
reference; a rank pickles its own result, so one that does not pickle is the caller's error), and
an error a worker raised carried back as itself, not as the engine's death.

A callable crosses by its qualified name, so it must be importable where the workers run (a
module-level function): Kiln has no cloudpickle to send a lambda's code.
"""
import pickle
from dataclasses import dataclass

from kiln.core.core_messages import CoreFailed, failure_report


@dataclass
class RpcFailure:
    """What a worker raised in a collective_rpc call, instead of its result."""
    failure: CoreFailed


def dumps_call(method, args: tuple, kwargs: dict | None) -> bytes:
    if callable(method) and getattr(method, "__module__", None) == "__main__":
        # pickled as __main__.<name>, which the engine's process (its own __main__) lacks
        raise ValueError(f"collective_rpc: {getattr(method, '__qualname__', method)!r} is "
                         "defined in the script being run (__main__), which the engine's "
                         "process cannot import; move it into a module it can import, or "
                         "pass a worker method's name")
    try:
        return pickle.dumps((method, tuple(args), kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"collective_rpc: {method!r} and its arguments cannot be sent to the "
                         f"engine's workers ({e}); pass a worker method's name or a module-level "
                         "function (a lambda or a local function cannot be pickled), and "
                         "arguments that pickle") from None


def loads(data: bytes):
    return pickle.loads(data)


@dataclass
class PickledResult:
    """A rank's result, pickled in the rank, so one that does not pickle is found there."""
    data: bytes


def _unsendable(results, e: Exception) -> ValueError:
    # Any error: a model's oneDNN-packed tensors raise NotImplementedError, not PicklingError
    kinds = ", ".join(sorted({type(r).__name__ for r in results})) \
        if isinstance(results, list) else type(results).__name__
    return ValueError(f"collective_rpc: the workers' results ({kinds}) cannot "
                      f"be sent back across processes ({type(e).__name__}: {e}); return values "
                      "that pickle (plain data, tensors), e.g. not the model itself")


def dumps_results(results: list) -> bytes:
    try:
        return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises is the caller's error
        raise _unsendable(results, e) from None


def rank_result(result):
    """A rank's collective_rpc result as it goes back to the engine: pickled here, so one that
    does not pickle is the caller's error (RpcFailure), not the rank's death mid-reply."""
    if isinstance(result, RpcFailure):
        return result
    try:
        return PickledResult(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:  # noqa: BLE001 - whatever pickling raises is the caller's error
        return RpcFailure(failure_report(_unsendable(result, e)))


def guarded(call, *args):
    """`call(*args)`, or its exception as an RpcFailure (a worker's error is the caller's)."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001 - handed back to the caller
        return RpcFailure(failure_report(e))


def raise_failures(results: list) -> list:
    """`results`, unless a worker failed: then its error, as its own kind where that is a
    built-in or Kiln's (ValueError stays ValueError)."""
    for rank, result in enumerate(results):
        if isinstance(result, RpcFailure):
            raise error_from(result.failure, f"worker rank {rank}: " if len(results) > 1 else "")
    return [loads(r.data) if isinstance(r, PickledResult) else r for r in results]


def error_from(failure: CoreFailed, where: str = "") -> Exception:
    from kiln.engine.core_errors import error_class

    kind = error_class(failure)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(f"{where}{failure.message}")
        except Exception:  # noqa: BLE001 - an exception type that wants other arguments
            pass
    return RuntimeError(f"{where}{failure.error_type}: {failure.message}")
