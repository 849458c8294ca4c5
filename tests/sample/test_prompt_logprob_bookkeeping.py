"""Prompt-logprob bookkeeping without a model: which positions a step predicts, which hidden
rows hold them, and how a request collects chunks (recomputed ones after preemption skipped)."""
import pytest

from kiln.core.request import Request
from kiln.sample.prompt_logprobs import (
    LOGITS_BYTES_PER_CHUNK,
    compute_prompt_logprobs,
    hidden_rows,
    predicting_positions,
    rows_per_chunk,
)
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


def test_rows_per_chunk_keeps_the_logits_under_the_budget():
    assert rows_per_chunk(49152) * 49152 * 4 <= LOGITS_BYTES_PER_CHUNK
    assert rows_per_chunk(49152) >= 64
    assert rows_per_chunk(10 ** 9) == 1  # at least one row


def test_chunked_prompt_logprobs_equal_one_chunk(monkeypatch):
    import torch

    from kiln.sample import prompt_logprobs

    g = torch.Generator().manual_seed(3)
    head = torch.randn(50, 8, generator=g)  # vocab 50, hidden 8
    hidden = torch.randn(23, 8, generator=g)
    targets = torch.randint(0, 50, (23,), generator=g).tolist()
    whole = compute_prompt_logprobs(lambda h: h @ head.T, hidden, targets, 3, 50)
    monkeypatch.setattr(prompt_logprobs, "LOGITS_BYTES_PER_CHUNK", 4 * 50 * 5)  # 5 rows
    assert prompt_logprobs.rows_per_chunk(50) == 5
    calls = []
    chunked = compute_prompt_logprobs(lambda h: calls.append(len(h)) or h @ head.T, hidden,
                                      targets, 3, 50)
    assert calls == [5, 5, 5, 5, 3]
    assert len(chunked) == len(whole) == 23
    for a, b in zip(chunked, whole):  # the matmul may round differently for fewer rows
        assert (a.token_ids, a.sampled_rank) == (b.token_ids, b.sampled_rank)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
