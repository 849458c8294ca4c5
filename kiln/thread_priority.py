"""Lowering the OS priority of one thread (Linux schedules threads by their own niceness), so
background work (huge inputs, grammar compiles) yields the CPU to engine steps.
"""
import os
import threading


def lower_this_thread(niceness: int) -> None:
    """Add `niceness` (capped at 19) to the calling thread's; threads it starts inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness))
    except (AttributeError, OSError):  # not Linux, or not allowed: the work still runs
        pass
