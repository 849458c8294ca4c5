"""A rank's error as the engine reports it. At start-up (load, KV cache sizing, compile) a
setting the model or machine cannot meet (a ConfigError, a missing file) or a piece that will not
compile is raised again in the engine as the same kind with the rank's one-line message, as a
one-rank engine raises it: the CLI then prints one line naming the flag, not the rank's
traceback (which the log keeps). Any other error, or any error of a step, fails the ranks as
WorkerFailedError with the rank's traceback."""
import logging

from kiln.core.core_messages import CoreFailed
from kiln.errors import is_user_error
from kiln.logger import init_logger

logger = init_logger(__name__)


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
