"""vLLM's rejection sampler for one-hot (n-gram) drafts keeps the target distribution: many
requests with the same logits and drafts, the emitted tokens' frequencies against the target
probabilities after the request's temperature / top-k processing (chi-square)."""
import torch

from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.rejection_sampler import draw_uniforms, rejection_sample

V = 6
N = 4000
CHI2_DF5_P001 = 20.52  # chi-square quantile 0.999 at 5 degrees of freedom


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def target_of(params: SamplingParams, rows: int, seed: int):
    """The per-position logits of the case `seed`, and their target probabilities."""
    torch.manual_seed(seed)
    per_req = torch.randn(rows, V) * 1.5
    return per_req, Sampler.probs(per_req, build_sampling_metadata(
        [params] * rows, [[3]] * rows, [[]] * rows, [None] * rows, None, V, "cpu"))


def run(params: SamplingParams, drafts: list[int], seed: int):
    rows = len(drafts) + 1
    per_req, target = target_of(params, rows, seed)
    logits = per_req.repeat(N, 1)
    meta = build_sampling_metadata([params] * (N * rows), [[3]] * (N * rows),
                                   [[]] * (N * rows), [None] * (N * rows), None, V,
                                   torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    u = draw_uniforms([rows] * N, [False] * N, [None] * N, gen, "cpu")
    emitted, _, _ = rejection_sample(Sampler(), logits, meta, [drafts] * N, [False] * N, u)
    return emitted, target


def test_first_and_second_tokens_follow_the_target_whatever_the_draft():
    params = SamplingParams(temperature=0.8, top_k=5)
    checked_second = 0
    for seed, drafts in enumerate([[0, 1], [3, 3], ["top", 0], ["top", 5]]):
        if drafts[0] == "top":  # the target's likeliest token: accepted often
            drafts = [int(target_of(params, 3, seed)[1][0].argmax()), drafts[1]]
        emitted, target = run(params, drafts, seed)
        first = torch.tensor([e[0] for e in emitted])
        assert chi_square(first, target[0]) < CHI2_DF5_P001, (drafts, target[0])
        # after the first draft was accepted, the next token follows row 1's target
        second = torch.tensor([e[1] for e in emitted if e[0] == drafts[0]])
        if second.numel() > 600:
            checked_second += 1
            assert chi_square(second, target[1]) < CHI2_DF5_P001, (drafts, target[1])
        # drafts are accepted as often as the target gives them
        rate = sum(e[0] == drafts[0] and len(e) > 1 for e in emitted) / N
        assert abs(rate - float(target[0, drafts[0]])) < 0.03
        # every run of accepted drafts ends with one token that is not the next draft
        assert all(len(e) <= len(drafts) + 1 for e in emitted)
    assert checked_second >= 2


def test_a_draft_the_target_rules_out_is_never_accepted():
    _, target = target_of(SamplingParams(temperature=1.0, top_k=2), 3, 7)
    banned = [t for t in range(V) if target[0, t] == 0]
    emitted_b, _ = run(SamplingParams(temperature=1.0, top_k=2), [banned[0], 0], 7)
    assert all(e[0] != banned[0] for e in emitted_b)
    first = torch.tensor([e[0] for e in emitted_b])
    assert chi_square(first, target[0]) < CHI2_DF5_P001


def test_greedy_accepts_exactly_the_argmax_run():
    logits = torch.tensor([[0., 5, 1, 0, 0, 0], [0, 0, 0, 7, 0, 0], [9, 0, 0, 0, 0, 0]])
    meta = build_sampling_metadata([SamplingParams(temperature=0)] * 3, [[3]] * 3, [[]] * 3,
                                   [None] * 3, None, V, "cpu")
    u = torch.zeros(3, dtype=torch.float64)
    for drafts, want in (([1, 3], [1, 3, 0]), ([1, 2], [1, 3]), ([2, 3], [1])):
        emitted, row_tokens, _ = rejection_sample(Sampler(), logits, meta, [drafts], [True], u)
        assert emitted == [want]
        assert row_tokens.tolist()[:len(want)] == want
