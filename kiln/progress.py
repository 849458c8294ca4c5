"""Progress bars (tqdm) for the slow parts of a start: the default model's unpacking, weight
loading, compilation / warm-up. Drawn on stderr only when it is a terminal: logs, pipes and
tests see nothing."""
import sys
from collections.abc import Iterable


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
             unit: str = "it", unit_scale: bool = False):
    """A tqdm over `iterable` (or, without one, a bar to update()), disabled off a terminal;
    it disappears when done (leave=False), so the log above it stays as it was."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale,
                file=sys.stderr, disable=not sys.stderr.isatty(), leave=False,
                dynamic_ncols=True)
