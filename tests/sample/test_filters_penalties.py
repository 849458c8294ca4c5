"""Pure-function tests for the sampling filters (top-k, top-p, min-p) and the logit penalties."""
import math

import torch

from kiln.sample.filters import apply_min_p, apply_top_k, apply_top_p
from kiln.sample.penalties import (
    apply_all_penalties,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    first_occurrences,
    mask_min_tokens,
)

NEG = float("-inf")


def test_top_k_keeps_k_highest_and_zero_is_off():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]
    assert torch.equal(out[1], logits[1])


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = apply_top_p(logits, torch.tensor([0.7, 0.1, 1.0]))
    # 0.5 + 0.3 reaches 0.7: the two most likely survive.
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    # Even a tiny top_p keeps the most likely token.
    assert torch.isfinite(out[1]).tolist() == [True, False, False, False]
    assert torch.equal(out[2], logits[2])


def _top_p_by_sort(logits, top_p):
    """Reference: sort each row; a token stays when the tokens above it hold less than top_p."""
    probs = logits.softmax(dim=1)
    out = logits.clone()
    for r in range(logits.shape[0]):
        if top_p[r] >= 1.0:
            continue
        ordered, idx = probs[r].sort(descending=True)
        above = ordered.double().cumsum(0) - ordered.double()
        drop = above >= top_p[r].item()
        drop[0] = False
        out[r, idx[drop]] = NEG
    return out


def test_top_p_matches_sorting_the_whole_row():
    """Peaked rows find their nucleus in the top 256, flatter ones in the top 2048, the
    flattest by sorting; rows with top_p off are left alone."""
    g = torch.Generator().manual_seed(11)
    scales = [8.0, 3.0, 0.05, 8.0, 1.0, 3.0]
    logits = torch.cat([torch.randn(1, 5000, generator=g) * s for s in scales])
    top_p = torch.tensor([0.9, 0.9, 0.95, 1.0, 0.5, 0.999])
    assert torch.equal(apply_top_p(logits, top_p), _top_p_by_sort(logits, top_p))


def test_top_k_matches_sorting_the_whole_row():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 3000, generator=g)
    top_k = torch.tensor([1, 0, 700, 3000, 5000])  # 0 and >= vocab: off
    out = apply_top_k(logits, top_k)
    for r, k in enumerate(top_k.tolist()):
        keep = torch.isfinite(out[r])
        if not 0 < k < 3000:
            assert keep.all()
        else:
            assert keep.sum() == k and logits[r][keep].min() >= logits[r][~keep].max()


def test_min_p_relative_to_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.35, 0.0]))
    # threshold 0.35 * 0.5 = 0.175
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).all()


def test_first_occurrences():
    ids = torch.tensor([[1, 1, 3, 5, 3], [0, 5, 5, 5, 2]])
    assert first_occurrences(ids).tolist() == [[True, False, True, True, False],
                                                [True, True, False, False, True]]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.0]])  # last column: the padding id's
    seen = torch.tensor([[0, 1, 1, 4]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out[:, :4].tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_presence_frequency_by_hand():
    logits = torch.zeros(1, 5)
    output = torch.tensor([[2, 1, 2, 4, 2]])  # 4: padding
    out = apply_presence_frequency_penalties(logits, output, torch.tensor([0.5]),
                                             torch.tensor([0.25]))
    assert out[:, :4].tolist() == [[0.0, -0.75, -1.25, 0.0]]


def test_all_penalties_prompt_only_for_repetition():
    vocab = 6
    logits = torch.tensor([[3.0, 3.0, 3.0, -3.0, 3.0, 3.0]])
    prompt = torch.tensor([[0, 3, vocab]])  # 0 and 3 are in the prompt
    output = torch.tensor([[1, 1, vocab]])  # 1 generated twice
    out = apply_all_penalties(logits, prompt, output, torch.tensor([1.5]), torch.tensor([1.0]),
                              torch.tensor([0.5]))
    expected = [3 / 1.5, 3 / 1.5 - 0.5 * 2 - 1.0, 3.0, -3 * 1.5, 3.0, 3.0]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(out[0].tolist(), expected))
    assert logits[0, 0] == 3.0  # the input is left alone


def test_all_penalties_match_the_whole_vocabulary_form():
    """Against the dense definition: counts over the vocabulary, penalties on every token."""
    g = torch.Generator().manual_seed(13)
    n, vocab = 4, 300
    logits = torch.randn(n, vocab, generator=g) * 3
    prompt = torch.randint(0, vocab + 1, (n, 40), generator=g)  # vocab: padding
    output = torch.randint(0, 30, (n, 25), generator=g)  # repeats
    output[:, -3:] = vocab
    rep, pres, freq = (torch.tensor([1.0, 1.3, 0.8, 2.0]), torch.tensor([0.0, 0.5, -0.2, 1.0]),
                       torch.tensor([0.0, 0.25, 0.1, -0.5]))

    def counts(ids):
        c = torch.zeros(n, vocab + 1).scatter_add_(1, ids, torch.ones(ids.shape))
        return c[:, :vocab]

    out_counts = counts(output)
    seen = (counts(prompt) > 0) | (out_counts > 0)
    p = rep.unsqueeze(1)
    want = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    want = want - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0)
    got = apply_all_penalties(logits, prompt, output, rep, pres, freq)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_mask_min_tokens():
    logits = torch.zeros(2, 4)
    mask_min_tokens(logits, torch.tensor([0, 0]), torch.tensor([1, 3]))
    assert logits.tolist() == [[0.0, NEG, 0.0, NEG], [0.0] * 4]
