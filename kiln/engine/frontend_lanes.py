"""The front end's claim on the CPU. Its tokenizer and template threads: one for ordinary
inputs, one for huge ones, so a short prompt never queues behind a 4 MB body; the huge-input
thread runs at a lower OS priority (Linux: per thread), so the engine core and the event loop
get the CPU first. And the whole front end may yield to its engine core (lower_front_end)."""
import concurrent.futures
import dataclasses
import os
from collections.abc import Callable

from pydantic import BaseModel

from kiln.thread_priority import lower_this_thread, lower_thread

# Inputs past this many characters (or list items) take the bulk lane.
BULK_CHARS = 64 * 1024
# The bulk thread's niceness, added to the process's (0-19; higher yields more).
BULK_NICENESS = 10
_DEPTH = 4  # how deep input_size looks into messages: [{"content": [{"text": ...}]}]
# What each item of a long list counts for, so that a list of thousands of messages is bulk
# without being walked item by item (input_size runs on the event loop).
ITEM_CHARS = 16


def input_size(obj, depth: int = _DEPTH) -> int:
    """Characters of text (and ids of token lists) in a call's argument: prompts, prompt
    dicts, chat messages (dicts or request models), sampling params (bad_words are tokenized
    word by word: 100,000 of them in a short prompt's call held every short prompt behind it).
    Cheap: lengths only, never the text itself, and a list or dict of more than
    BULK_CHARS / ITEM_CHARS items is not walked."""
    if isinstance(obj, str):
        return len(obj)
    if depth == 0:
        return 0
    if isinstance(obj, BaseModel) or (dataclasses.is_dataclass(obj)
                                      and not isinstance(obj, type)):
        obj = obj.__dict__  # its fields, at the model's own depth
    if isinstance(obj, dict):
        if len(obj) * ITEM_CHARS > BULK_CHARS:  # logit_bias of the whole vocabulary
            return len(obj) * ITEM_CHARS
        return sum(input_size(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if obj and isinstance(obj[0], int):
            return len(obj)
        if len(obj) * ITEM_CHARS > BULK_CHARS:
            return len(obj) * ITEM_CHARS
        return sum(input_size(v, depth - 1) for v in obj)
    return 0


def is_bulk(args, kwargs) -> bool:
    total = 0
    for value in (*args, *kwargs.values()):
        total += input_size(value)
        if total > BULK_CHARS:
            return True
    return False


# The front end's niceness where it shares every core with the engine core's threads.
SHARED_CORES_NICENESS = 5


def usable_cores() -> int:
    """Cores this process may run on (its affinity; the engine core's process inherits it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def frontend_niceness(chosen: int | None, core_threads: int | None,
                      cores: int | None = None) -> int:
    """The user's choice, else: none where the core's threads leave this process a core (it
    then needs no priority below theirs, and a lower one loses its core to whatever else runs
    there), SHARED_CORES_NICENESS where they take every core."""
    if chosen is not None:
        return chosen
    if cores is None:
        cores = usable_cores()
    if core_threads and core_threads < cores:
        return 0
    return SHARED_CORES_NICENESS


def lower_front_end(niceness: int) -> int:
    """Add `niceness` to every thread of this process (threads started later inherit it from
    their creator), not to the engine core's process started before: where both share a
    few cores, a step then never waits for front-end work (connections, JSON, tokenizing).
    How many threads were lowered (0 where the OS does not allow it)."""
    if niceness <= 0:
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return 0
    return sum(lower_thread(tid, niceness) for tid in tids)


class FrontendLanes:
    """Two one-thread pools; `submit` picks by the size of the call's arguments."""

    def __init__(self):
        self.ordinary = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kiln-frontend")
        self.bulk = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kiln-frontend-bulk", initializer=lower_this_thread,
            initargs=(BULK_NICENESS,))

    def pool_for(self, args, kwargs) -> concurrent.futures.ThreadPoolExecutor:
        return self.bulk if is_bulk(args, kwargs) else self.ordinary

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        return self.pool_for(args, kwargs).submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self.ordinary.shutdown(wait=True)
        self.bulk.shutdown(wait=True)
