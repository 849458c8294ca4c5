"""Warm-up driver: run the model at every compiled shape (and the worker's sizes), then end it.

The worker passes its dummy-run function; after this, a compile is an error.
"""
from collections.abc import Callable

from kiln.compilation import monitor
from kiln.compilation.phase import WarmupPhase
from kiln.progress import progress


def sizes_to_run(max_num_batched_tokens: int, compile_sizes: list[int], compiled: bool,
                 extra_sizes: list[int] = ()) -> list[int]:
    """What warm-up runs, largest first: `extra_sizes` and, when the model compiles, each
    compile size (its specialised artifact). The first call of a compiled model traces and
    compiles the range artifact, which serves every size whatever size it was traced at
    (measured on the default model: traced at 64 or at 2048 tokens, prefill and decode run
    alike), so no full-budget forward, seconds on a CPU, is needed. That first size must be at
    least 2: Dynamo specialises a dim it first sees as 1."""
    sizes = set(extra_sizes)
    if compiled:
        sizes |= {s for s in compile_sizes if s <= max_num_batched_tokens}
        if max(sizes, default=0) < 2:
            sizes.add(min(2, max_num_batched_tokens))
    return sorted(sizes, reverse=True)


def compile_and_warm_up(run: Callable[[int], object], kiln_config, phase: WarmupPhase,
                        extra_sizes: list[int] = ()) -> None:
    """Call `run(num_tokens)` for every compiled shape (plus `extra_sizes`), then end `phase`,
    the warm-up of the engine whose model `run` calls (its CompileState's)."""
    sched, cc = kiln_config.scheduler_config, kiln_config.compilation_config
    first_event = len(monitor.stats.events)
    sizes = sizes_to_run(sched.max_num_batched_tokens, cc.compile_sizes, bool(cc.mode),
                         extra_sizes)
    # The first size compiles (or loads) the range artifact: most of the time is there.
    for size in progress(sizes, desc="compiling / warming up" if cc.mode else "warming up",
                         unit=" shapes"):
        run(size)
    phase.end()
    if cc.mode:  # mode 0 compiled nothing
        monitor.log_total(since=first_event)
