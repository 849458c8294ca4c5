"""Progress bars (tqdm) for the slow parts of a start: the default model's unpacking, weight
loading, compilation / warm-up. Drawn on stderr only when it is a terminal: logs, pipes and
tests see nothing."""
import sys
import threading
from collections.abc import Iterable

# tqdm's default lock holds a multiprocessing semaphore, which each rank process left to the
# resource tracker ("2 leaked semaphore objects" at every exit of a two-rank engine); each
# process draws only its own bars, so a thread lock serves.
_LOCK = threading.RLock()


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
             unit: str = "it", unit_scale: bool = False):
    """A tqdm over `iterable` (or, without one, a bar to update()), disabled off a terminal;
    it disappears when done (leave=False), so the log above it stays as it was."""
    from tqdm import tqdm

    tqdm.set_lock(_LOCK)
    return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale,
                file=sys.stderr, disable=not sys.stderr.isatty(), leave=False,
                dynamic_ncols=True)
