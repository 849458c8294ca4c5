"""Fixtures of the multi-rank engine tests."""
import signal

import pytest

from parallel_helpers import shutdown_and_check_ranks_exit


@pytest.fixture(autouse=True)
def _core_here(inprocess_core):
    """These tests read the executor's ranks, procs and counters: the core runs in this
    process (rank processes are still its children)."""


@pytest.fixture
def ranks_exit():
    return shutdown_and_check_ranks_exit


BOUND_S = 120


@pytest.fixture
def bounded():
    """An alarm that fails the test if it hangs."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {BOUND_S} s: the engine hung")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(BOUND_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
