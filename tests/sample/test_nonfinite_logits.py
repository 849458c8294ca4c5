"""Logits with NaN or +inf: NaN tokens are never sampled (greedy or random), +inf ones always,
a row with nothing finite gives token 0 with -inf logprobs, the other rows are untouched, and
the engine is told (a warning and `SamplerOutput.nonfinite_rows`)."""
import math

import pytest
import torch

from kiln.sample import nonfinite
from kiln.sample.row_reductions import has_nan_or_posinf
from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

V = 300
NAN, INF = float("nan"), float("inf")


def run(logits, params, default_seed=0):
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for p in params]
    meta = build_sampling_metadata(params, [[1]] * len(params), [[] for _ in params], gens,
                                   torch.Generator().manual_seed(default_seed), V,
                                   torch.device("cpu"))
    return Sampler()(logits, meta)


@pytest.fixture
def warnings(monkeypatch):
    seen = []
    monkeypatch.setattr(nonfinite, "_times_seen", 0)
    monkeypatch.setattr(nonfinite.logger, "warning", lambda msg, *a: seen.append(msg % a))
    return seen


def test_has_nan_or_posinf():
    x = torch.randn(3, 500)
    x[1, 4] = -INF
    for t in (x, x.bfloat16(), x[:, ::2], x[:0]):
        assert not has_nan_or_posinf(t)
    for bad in (NAN, INF):
        y = x.clone()
        y[2, 77] = bad
        for t in (y, y.bfloat16(), y[:, 1:]):
            assert has_nan_or_posinf(t)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_token_is_never_chosen(temperature, warnings):
    logits = torch.randn(200, V, generator=torch.Generator().manual_seed(1))
    logits[:, 40] = NAN  # was the greedy choice: NaN compares as the largest
    logits[:, 41] = 50.0 if temperature == 0 else 0.0
    params = [SamplingParams(temperature=temperature, logprobs=2)] * 200
    out = run(logits, params)
    assert not (out.sampled_token_ids == 40).any()
    if temperature == 0:
        assert (out.sampled_token_ids == 41).all()
    assert out.nonfinite_rows.all()
    assert not out.logprobs.isnan().any()
    assert (out.logprob_token_ids[:, 1:] != 40).all()
    assert len(warnings) == 1 and "NaN" in warnings[0] and "--dtype" in warnings[0]


def test_the_rest_of_a_nan_row_keeps_its_distribution(warnings):
    n = 6000
    row = torch.randn(V, generator=torch.Generator().manual_seed(2)) * 2
    row[:3] = torch.tensor([3.0, 2.5, 2.0])
    broken = row.clone()
    broken[[0, 100]] = NAN
    logits = broken.unsqueeze(0).expand(n, V).contiguous()
    out = run(logits, [SamplingParams(temperature=1.0)] * n).sampled_token_ids
    ref = row.clone()
    ref[[0, 100]] = -INF
    ref = ref.double().softmax(0)
    freq = torch.bincount(out, minlength=V).double() / n
    assert freq[0] == 0 and freq[100] == 0
    m = ref > 1e-3
    assert ((freq[m] - ref[m]).abs() < 5 * (ref[m] / n).sqrt() + 1e-3).all()


def test_all_nan_row_does_not_disturb_the_batch(warnings):
    g = torch.Generator().manual_seed(3)
    good = torch.randn(2, V, generator=g)
    params = [SamplingParams(temperature=1.0, seed=5, logprobs=3),
              SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0, seed=6)]
    alone = [run(good[:1], params[:1]), run(good[1:], params[1:2])]
    batch = torch.cat([good[:1], torch.full((1, V), NAN), good[1:]])
    out = run(batch, [params[0], SamplingParams(temperature=1.0, seed=7, logprobs=3),
                      params[1]])
    assert out.sampled_token_ids[1] == 0
    assert out.logprobs[1].tolist() == [-INF] * 4
    assert out.nonfinite_rows.tolist() == [False, True, False]
    for i, ref in ((0, alone[0]), (2, alone[1])):
        assert out.sampled_token_ids[i] == ref.sampled_token_ids[0]
        assert torch.equal(out.logprobs[i], ref.logprobs[0])
    assert "[1] of 3" in warnings[0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_posinf_tokens_are_the_only_ones_sampled(temperature, warnings):
    logits = torch.randn(400, V, generator=torch.Generator().manual_seed(4))
    logits[:, [9, 250]] = INF  # a float16 overflow
    logits[:, 10] = 6e4
    params = [SamplingParams(temperature=temperature, top_p=0.5, logprobs=1)] * 400
    out = run(logits, params)
    got = set(out.sampled_token_ids.tolist())
    assert got == ({9} if temperature == 0 else {9, 250})
    assert torch.allclose(out.logprobs[:, 0], torch.full((400,), math.log(0.5)))


def test_warnings_thin_out(warnings):
    logits = torch.zeros(1, V)
    logits[0, 3] = NAN
    for _ in range(9):
        run(logits, [SamplingParams(temperature=0)])
    assert [w.split("(step ")[1].split(" ")[0] for w in warnings] == ["1", "2", "4", "8"]


def test_finite_logits_report_nothing(warnings):
    logits = torch.randn(2, V)
    logits[0, :5] = -INF
    out = run(logits, [SamplingParams(temperature=1.0, logprobs=1)] * 2)
    assert out.nonfinite_rows is None and not warnings


def test_prompt_logprobs_hold_no_nan(warnings):
    from kiln.sample.prompt_logprobs import compute_prompt_logprobs

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    logits[0, 7] = NAN
    logits[1] = NAN
    entries = compute_prompt_logprobs(lambda rows: logits[rows.long()], torch.arange(3),
                                      [7, 8, 9], 2, V)
    for e in entries:
        assert not any(math.isnan(x) for x in e.logprobs)
    assert entries[0].logprobs[0] == -INF and entries[0].token_ids[1:].count(7) == 0
    assert entries[1].logprobs == [-INF] * 3
    assert entries[2].logprobs[0] == pytest.approx(logits[2].log_softmax(0)[9].item())
    assert len(warnings) == 1
