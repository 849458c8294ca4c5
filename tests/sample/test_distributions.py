"""Empirical draws of the sampler against the exact target distribution of vLLM's v1 sampler:
softmax(logits / T) with min-p, then top-k, then top-p applied (each on what is left), and rows of a
batch that do not influence one another. Seeded, so every statistic is the same on every run."""
import math

import pytest
import torch

from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

DRAWS = 8000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """vLLM v1's order, in float64 and by sorting: temperature, min-p (relative to the top
    token), top-k (ties with the k-th kept), top-p (a token stays when the tokens above it hold
    less than top_p; ties with the last kept are kept, as Kiln documents)."""
    lg = logits.double() / temperature
    if min_p > 0:
        p = lg.softmax(0)
        lg = lg.masked_fill(p < min_p * p.max(), -math.inf)
    if 0 < top_k < lg.numel():
        lg = lg.masked_fill(lg < lg.topk(top_k).values[-1], -math.inf)
    if top_p < 1:
        p = lg.softmax(0)
        ordered = p.sort(descending=True).values
        keep = (ordered.cumsum(0) - ordered) < top_p
        keep[0] = True
        lg = lg.masked_fill(p < ordered[keep].min(), -math.inf)
    return lg.softmax(0)


def draw(row: torch.Tensor, params: SamplingParams, n: int = DRAWS, seed: int = 0):
    """Token frequencies of n independent draws: n batch rows holding the same logits."""
    vocab = row.shape[0]
    logits = row.unsqueeze(0).expand(n, vocab).contiguous()
    meta = build_sampling_metadata([params] * n, [[]] * n, [[] for _ in range(n)], [None] * n,
                                   torch.Generator().manual_seed(seed), vocab,
                                   torch.device("cpu"))
    out = Sampler()(logits, meta).sampled_token_ids
    return torch.bincount(out, minlength=vocab).double() / n


def assert_matches(freq: torch.Tensor, ref: torch.Tensor, n: int = DRAWS):
    """No draw outside the target's support, and Pearson's chi-square within ~6 sigma."""
    outside = (freq > 0) & (ref == 0)
    assert not outside.any(), f"drew tokens with target probability 0: {outside.nonzero()}"
    m = ref > 0
    dof = max(int(m.sum()) - 1, 1)
    stat = ((freq[m] - ref[m]) ** 2 / ref[m]).sum().item() * n
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof)


def _logits(vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


CASES = [
    (dict(temperature=1.0), 33),
    (dict(temperature=0.5, top_k=5), 257),
    (dict(temperature=1.0, top_p=0.7), 600),
    (dict(temperature=1.0, min_p=0.1), 257),
    (dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05), 600),
    (dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05), 33),
    (dict(temperature=2.0, top_p=0.9, min_p=0.2), 101),
]


@pytest.mark.parametrize("kw,vocab", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_filtered_softmax(kw, vocab, dtype):
    row = _logits(vocab, 2.0, seed=vocab).to(dtype)
    params = SamplingParams(**kw)
    ref = reference_probs(row.float(), params.temperature, params.top_k, params.top_p,
                          params.min_p)
    assert_matches(draw(row, params), ref)


def test_min_p_comes_before_top_p_as_in_vllm():
    """probs 0.5 / 0.3 / 0.2, min_p 0.5 drops the 0.2; top_p 0.6 then sees 0.625 / 0.375 and
    keeps the top token only. Applying min_p last kept the 0.3 one (drawn 37% of the time)."""
    row = torch.tensor([0.5, 0.3, 0.2]).log()
    freq = draw(row, SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5), n=2000)
    assert freq.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("kw", [dict(top_p=1e-9), dict(top_k=1), dict(min_p=1.0),
                                dict(temperature=1e-5)])
def test_settings_that_leave_only_the_argmax(kw):
    row = _logits(999, 3.0, seed=7)
    freq = draw(row, SamplingParams(**{"temperature": 1.0, **kw}), n=500)
    assert freq[row.argmax()] == 1.0


def test_minus_infinity_entries_are_never_drawn():
    only = torch.full((100,), -math.inf)
    only[37] = -3.0
    assert draw(only, SamplingParams(temperature=1.0), n=500)[37] == 1.0
    row = _logits(70, 3.0, seed=8)
    row[:10] = -math.inf
    params = SamplingParams(temperature=0.7, top_p=0.95)
    assert_matches(draw(row, params), reference_probs(row, 0.7, top_p=0.95))


def test_huge_logits_do_not_overflow():
    row = _logits(50, 1000.0, seed=9)
    assert draw(row, SamplingParams(temperature=1.0), n=500)[row.argmax()] == 1.0
    row = torch.tensor([1e4, 1e4 - 1.0, -1e4])
    assert_matches(draw(row, SamplingParams(temperature=1.0)), reference_probs(row, 1.0))


def test_rows_with_different_settings_do_not_leak():
    """Each of a mixed batch's settings gives, row by row, the distribution it gives alone."""
    vocab, n = 64, 6000
    row = _logits(vocab, 2.0, seed=10)
    kinds = [dict(temperature=0.0), dict(temperature=1.0, top_k=3), dict(temperature=1.5),
             dict(temperature=0.8, top_p=0.5), dict(temperature=1.0, min_p=0.3)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(n * len(kinds))]
    logits = row.unsqueeze(0).expand(len(params), vocab).contiguous()
    meta = build_sampling_metadata(params, [[]] * len(params), [[] for _ in params],
                                   [None] * len(params), torch.Generator().manual_seed(1),
                                   vocab, torch.device("cpu"))
    out = Sampler()(logits, meta).sampled_token_ids
    for i, kw in enumerate(kinds):
        mine = out[i::len(kinds)]
        if kw["temperature"] == 0.0:
            assert (mine == row.argmax()).all()
            continue
        p = SamplingParams(**kw)
        freq = torch.bincount(mine, minlength=vocab).double() / n
        assert_matches(freq, reference_probs(row, p.temperature, p.top_k, p.top_p, p.min_p), n)
