"""Fixtures of the multi-rank engine tests."""
import pytest

from parallel_helpers import shutdown_and_check_ranks_exit


@pytest.fixture(autouse=True)
def _core_here(inprocess_core):
    """These tests read the executor's ranks, procs and counters: the core runs in this
    process (rank processes are still its children)."""


@pytest.fixture
def ranks_exit():
    return shutdown_and_check_ranks_exit
