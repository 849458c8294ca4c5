"""Pure-function tests for the sampling filters (top-k, top-p, min-p) and the logit penalties."""
import math

import torch

from kiln.sample.filters import apply_min_p, apply_top_k, apply_top_p
from kiln.sample.penalties import (apply_all_penalties, apply_presence_frequency_penalties,
                                   apply_repetition_penalty, mask_min_tokens, token_counts)

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


def test_token_counts_ignore_padding():
    ids = torch.tensor([[1, 1, 3, 5], [0, 5, 5, 5]])  # 5 == vocab_size is padding
    counts = token_counts(ids, 5)
    assert counts.tolist() == [[0, 2, 0, 1, 0], [1, 0, 0, 0, 0]]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_presence_frequency_by_hand():
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[0, 1, 3, 0]])
    out = apply_presence_frequency_penalties(logits, counts, torch.tensor([0.5]),
                                             torch.tensor([0.25]))
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0]]


def test_all_penalties_prompt_only_for_repetition():
    vocab = 6
    logits = torch.tensor([[3.0, 3.0, 3.0, -3.0, 3.0, 3.0]])
    prompt = torch.tensor([[0, 3, vocab]])  # 0 and 3 are in the prompt
    output = torch.tensor([[1, 1, vocab]])  # 1 generated twice
    out = apply_all_penalties(logits, prompt, output, torch.tensor([1.5]), torch.tensor([1.0]),
                              torch.tensor([0.5]))
    expected = [3 / 1.5, 3 / 1.5 - 0.5 * 2 - 1.0, 3.0, -3 * 1.5, 3.0, 3.0]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(out[0].tolist(), expected))


def test_mask_min_tokens():
    logits = torch.zeros(2, 4)
    mask_min_tokens(logits, torch.tensor([0, 0]), torch.tensor([1, 3]))
    assert logits.tolist() == [[0.0, NEG, 0.0, NEG], [0.0] * 4]
