"""Warm-up driver: run the model at every shape the compile stack serves, then end warm-up.

The worker passes its dummy-run function; after this, a compile is an error.
"""
from typing import Callable

from kiln.compilation import monitor


def warmup_sizes(max_num_batched_tokens: int, compile_sizes: list[int]) -> list[int]:
    """Largest first: the first call traces (and compiles the range) at the full budget, then
    each compile size gets its specialised artifact."""
    sizes = {max_num_batched_tokens, *(s for s in compile_sizes if s <= max_num_batched_tokens)}
    return sorted(sizes, reverse=True)


def sizes_to_run(max_num_batched_tokens: int, compile_sizes: list[int], compiled: bool,
                 extra_sizes: list[int] = ()) -> list[int]:
    """What warm-up runs, largest first: every compiled shape (when the model compiles) plus
    `extra_sizes`. Eager models skip the full-budget forward: it compiles nothing for them and
    costs seconds on a CPU (6 s for 2048 tokens of the default model on 2 cores)."""
    sizes = set(extra_sizes)
    if compiled:
        sizes |= set(warmup_sizes(max_num_batched_tokens, compile_sizes))
    return sorted(sizes, reverse=True)


def compile_and_warm_up(run: Callable[[int], object], kiln_config,
                        extra_sizes: list[int] = ()) -> None:
    """Call `run(num_tokens)` for every compiled shape (plus `extra_sizes`), then end warm-up."""
    sched, cc = kiln_config.scheduler_config, kiln_config.compilation_config
    for size in sizes_to_run(sched.max_num_batched_tokens, cc.compile_sizes, bool(cc.mode),
                             extra_sizes):
        run(size)
    cc.warmup_phase.end()
    if cc.mode:  # mode 0 compiled nothing
        monitor.log_total()
