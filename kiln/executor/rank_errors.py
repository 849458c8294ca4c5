"""A rank's error as the engine reports it. At start-up (load, KV cache sizing, compile) a
setting the model or machine cannot meet (a ConfigError, a missing file) or a piece that will not
compile is raised again in the engine as the same kind with the rank's one-line message, as a
one-rank engine raises it: the CLI then prints one line naming the flag, not the rank's
traceback (which the log keeps). Any other error, or any error of a step, fails the ranks as
WorkerFailedError with the rank's traceback; a rank that does not answer is named, with why
where /proc tells (stopped, stuck in the kernel)."""
import logging
import time

from kiln.core.core_messages import CoreFailed
from kiln.errors import is_user_error
from kiln.logger import init_logger

logger = init_logger(__name__)

# How long a rank may take to start (load, join the groups) before the engine gives up on it.
STARTUP_TIMEOUT_S = 600.0


class WorkerFailedError(RuntimeError):
    """A rank died or raised; the engine cannot continue with the ranks it has."""


def startup_error(report: CoreFailed, rank: int, what: str) -> BaseException | None:
    """The error the engine raises for a rank's `report` during `what`, where it is the user's
    to fix or a piece's compile error; None where the rank failed otherwise (a bug, a step)."""
    from kiln.compilation.piecewise import PieceCompileError
    from kiln.engine.core_errors import rebuild_error

    if what == "execute_model":
        return None
    error = rebuild_error(report)
    user = is_user_error(error)
    if not (user or isinstance(error, PieceCompileError)):
        return None
    # as a core process logs its own: a user error's traceback only helps debugging
    logger.log(logging.DEBUG if user else logging.ERROR, "worker rank %d failed during %s: %s",
               rank, what, report.traceback)
    return error


# /proc/<pid>/stat states that say why a rank does not answer (the others, waiting for it in a
# collective, are running or sleeping and do not answer either).
_STUCK_STATES = {"T": "is stopped (SIGSTOP, or a debugger)", "t": "is stopped by a debugger",
                 "D": "is stuck in the kernel (a device or a disk)"}


def process_state(pid: int) -> str:
    """The one-letter state /proc gives for `pid` ("" where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # past the name, which may hold spaces
    except (OSError, IndexError):
        return ""


def unanswered_message(what: str, ranks: list[int], timeout: float,
                       pids: dict[int, int] | None = None) -> str:
    """A call that `ranks` did not answer within `timeout` s, and what to do about it; `pids`
    (rank -> process id, where known) names a rank whose process is stopped or stuck."""
    message = (f"{what}: worker rank(s) {', '.join(map(str, ranks))} did not answer within "
               f"{timeout:g} s")
    stuck = [f"rank {r} (pid {pids[r]}) {_STUCK_STATES[state]}" for r in ranks
             if pids and r in pids and (state := process_state(pids[r])) in _STUCK_STATES]
    if stuck:
        message += f" ({'; '.join(stuck)})"
    if what == "execute_model":
        message += ("; a rank is stopped or stuck (a hung device, a deadlocked collective): "
                    "restart the engine, or raise KILN_EXECUTE_MODEL_TIMEOUT_SECONDS if steps "
                    "this long are expected")
    return message


# The longest one wait for the ranks may be: poll/epoll take milliseconds as a C int (24.8
# days); a longer step timeout (KILN_EXECUTE_MODEL_TIMEOUT_SECONDS=1e7, "never") is waited in
# slices, and a wait of its whole length raised OverflowError at every step, killing the engine.
MAX_WAIT_SLICE_S = 86400.0


def wait_slice(deadline: float | None) -> float | None:
    """Seconds to wait next for the ranks: what is left to `deadline` (a time.monotonic()),
    at most MAX_WAIT_SLICE_S; None (no deadline): without limit."""
    if deadline is None:
        return None
    return min(max(0.0, deadline - time.monotonic()), MAX_WAIT_SLICE_S)


def past(deadline: float | None) -> bool:
    """A wait that returned nothing ran out the step timeout, not only a slice of it."""
    return deadline is None or time.monotonic() >= deadline
