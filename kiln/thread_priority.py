"""Lowering the OS priority of threads (Linux schedules threads by their own niceness), so
background work (huge inputs, grammar compiles, a whole front end) yields the CPU to engine steps.
"""
import os
import threading


def lower_thread(tid: int, niceness: int) -> bool:
    """Add `niceness` (capped at 19) to thread `tid`'s; threads it starts later inherit it.
    False where the thread is gone or the OS does not allow it (the work runs all the same)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except (AttributeError, OSError):
        return False
    return True


def lower_this_thread(niceness: int) -> None:
    lower_thread(threading.get_native_id(), niceness)
