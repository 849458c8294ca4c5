"""Prompt-logprob bookkeeping without a model: which positions a step predicts, which hidden
rows hold them, and how a request collects chunks (recomputed ones after preemption skipped)."""
import pytest

from kiln.core.request import Request
from kiln.sample.prompt_logprobs import hidden_rows, predicting_positions
from kiln.sampling_params import SamplingParams


def test_positions_stop_before_the_last_prompt_token():
    assert predicting_positions(0, 48, 130) == range(0, 48)
    assert predicting_positions(96, 34, 130) == range(96, 129)  # the last predicts a new token
    assert not predicting_positions(130, 1, 130)  # decode steps predict no prompt token
    assert not predicting_positions(0, 1, 1)  # a one-token prompt has nothing to score
    assert hidden_rows(10, 96, range(96, 99)).tolist() == [10, 11, 12]


def test_request_collects_chunks_once_and_sends_them_once():
    r = Request("r", list(range(10)), SamplingParams(prompt_logprobs=1))
    r.add_prompt_logprobs(0, ["p1", "p2", "p3"])
    r.add_prompt_logprobs(0, ["p1", "p2", "p3", "p4"])  # recomputed after a preemption
    r.add_prompt_logprobs(4, ["p5"])
    assert r.prompt_logprobs == ["p1", "p2", "p3", "p4", "p5"]
    with pytest.raises(RuntimeError, match="position 7"):
        r.add_prompt_logprobs(7, ["p8"])
    assert r.take_prompt_logprobs() == ["p1", "p2", "p3", "p4", "p5"]
    assert r.take_prompt_logprobs() is None
    assert Request("s", [1, 2], SamplingParams()).take_prompt_logprobs() is None
