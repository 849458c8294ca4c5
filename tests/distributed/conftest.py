"""Fixtures of the multi-rank engine tests."""
import pytest

from parallel_helpers import shutdown_and_check_ranks_exit


@pytest.fixture
def ranks_exit():
    return shutdown_and_check_ranks_exit
