"""inverse_cdf: one uniform a row to an index drawn with the row's probabilities, across blocks,
at their boundaries, never onto a zero-probability entry."""
import math

import pytest
import torch

from kiln.native import build
from kiln.sample.inverse_cdf import BLOCK, inverse_cdf


def draw(probs: list[float] | torch.Tensor, u: float) -> int:
    p = torch.as_tensor(probs, dtype=torch.float32).reshape(1, -1)
    return int(inverse_cdf(p, torch.tensor([u], dtype=torch.float64))[0])


def test_intervals_of_the_cdf_map_to_their_entries():
    probs = [1.0, 1.0, 2.0, 0.0, 4.0]  # any total: intervals [0, 1) [1, 2) [2, 4) - [4, 8) of 8
    assert [draw(probs, u) for u in (0.0, 0.124, 0.125, 0.249, 0.25, 0.4999, 0.5, 0.99)] == \
        [0, 0, 1, 1, 2, 2, 4, 4]


def test_blocks_and_their_boundaries():
    vocab = 3 * BLOCK + 17  # padded to whole blocks
    probs = torch.zeros(vocab)
    probs[BLOCK - 1] = probs[BLOCK] = probs[2 * BLOCK + 5] = probs[vocab - 1] = 1.0
    picks = [draw(probs, u) for u in (0.0, 0.2499, 0.25, 0.4999, 0.5, 0.74, 0.75, 0.9999)]
    assert picks == [BLOCK - 1, BLOCK - 1, BLOCK, BLOCK, 2 * BLOCK + 5, 2 * BLOCK + 5,
                     vocab - 1, vocab - 1]


def test_zero_probability_entries_are_never_drawn_even_at_the_ends():
    probs = torch.zeros(2 * BLOCK)
    probs[BLOCK + 3] = 0.7
    probs[BLOCK + 9] = 0.3
    for u in (0.0, 1e-300, 0.7, math.nextafter(1.0, 0.0)):
        assert draw(probs, u) in (BLOCK + 3, BLOCK + 9)
    # Rounding must not run past the last entry with mass into the zeros after it: u * total
    # at the total itself is the worst rounding can do.
    assert draw([0.5] * 300 + [0.0] * 10, math.nextafter(1.0, 0.0)) == 299
    assert draw([0.5] * 300 + [0.0] * 10, 1.0) == 299
    assert draw(probs, 1.0) == BLOCK + 9


@pytest.mark.parametrize("fused", [False, True])
def test_draws_follow_the_probabilities(fused):
    """inverse_cdf over the probabilities, and the CPU kernel that fuses it with the softmax
    (csrc/sample_rows.c, over their logs: tests/sample/test_sample_rows.py)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 700, 200_000
    probs = torch.rand(vocab, generator=g) ** 4
    probs[::7] = 0
    probs /= probs.sum()
    u = torch.rand(n, dtype=torch.float64, generator=g)
    if fused:
        assert build.available()
        drawn = torch.ops.kiln.sample_rows_native(probs.log().expand(n, vocab), torch.ones(n), u)
    else:
        drawn = inverse_cdf(probs.expand(n, vocab), u)
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert counts[::7].sum() == 0
    expected = probs.double() * n
    seen = expected > 50
    chi2 = float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())
    dof = int(seen.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof)  # ~5 standard deviations of chi-square


def test_rows_are_independent_and_bad_rows_stay_in_range():
    probs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [float("nan")] * 3, [0.0] * 3])
    got = inverse_cdf(probs, torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64))
    assert got[:2].tolist() == [1, 0]
    assert all(0 <= i < 3 for i in got.tolist())
