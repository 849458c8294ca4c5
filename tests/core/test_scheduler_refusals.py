"""Requests the scheduler must refuse up front rather than let them wedge the step loop."""
import pytest

from kiln.core.scheduler import Scheduler

from .doubles import make_config, make_request


def test_empty_prompt_is_refused_at_add():
    # Admitted, it was scheduled for 0 tokens and every later update raised "no sampled token".
    sched = Scheduler(make_config(), num_blocks=8)
    with pytest.raises(ValueError, match="empty prompt_token_ids"):
        sched.add_request(make_request("e", []))
    assert not sched.has_unfinished_requests()
