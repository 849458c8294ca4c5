"""Beam search's pure parts (kiln.beam_search, kiln.entrypoints.beam_search.BeamSearch):
vLLM's length-penalized score, the ranking, and one prompt's search fed made-up candidates."""
import math

import pytest

from kiln.beam_search import (
    BeamSearchSequence,
    create_sort_beams_key_function,
    get_beam_search_score,
)
from kiln.entrypoints.beam_search import BeamSearch, step_params
from kiln.outputs import Logprob
from kiln.sampling_params import BeamSearchParams

EOS = 2


def test_score_is_vllms_formula():
    # the prompt counts, a final eos does not
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 1.0) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, EOS], -3.0, EOS, 1.0) == pytest.approx(-1.0)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 2.0) == pytest.approx(-2.0 / 16)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 0.0) == pytest.approx(-2.0)
    # an eos mid-sequence is just a token; no eos id: nothing is discounted
    assert get_beam_search_score([EOS, 6], -2.0, EOS, 1.0) == pytest.approx(-1.0)
    assert get_beam_search_score([5, EOS], -2.0, None, 1.0) == pytest.approx(-1.0)
    # a bare eos: length 1, not a ZeroDivisionError
    assert get_beam_search_score([EOS], -2.0, EOS, 1.0) == pytest.approx(-2.0)


def test_sort_key_prefers_longer_under_a_positive_penalty():
    short = BeamSearchSequence(tokens=[5, 6, EOS], cum_logprob=-1.0)  # length 2: -0.5
    long = BeamSearchSequence(tokens=[5, 6, 7, 8, 9], cum_logprob=-2.0)  # length 5: -0.4
    key = create_sort_beams_key_function(EOS, 1.0)
    assert sorted([short, long], key=key, reverse=True)[0] is long
    key0 = create_sort_beams_key_function(EOS, 0.0)  # plain sums: the short one
    assert sorted([short, long], key=key0, reverse=True)[0] is short


def lps(**by_token) -> dict[int, Logprob]:
    return {int(t[1:]): Logprob(v) for t, v in by_token.items()}


def test_search_keeps_the_best_by_sum_and_finishes_eos():
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    s = BeamSearch([9], params, EOS, max_model_len=100)
    assert [b.tokens for b in s.live()] == [[9]]
    s.advance([lps(t2=-0.1, t5=-0.5, t6=-1.0, t7=-2.0)])
    # eos finished at once; the best two others live
    assert [b.tokens for b in s.live()] == [[9, 5], [9, 6]]
    assert [(c.tokens, c.finish_reason) for c in s.completed] == [([9, EOS], "stop")]
    s.advance([lps(t7=-0.2, t8=-3.0), lps(t7=-0.1, t2=-0.2)])
    assert [b.tokens for b in s.live()] == []  # max_tokens reached
    best = s.result()
    # scores: [9,2] -0.1/1; [9,5,7] -0.7/3; [9,6,2] -1.2/2; [9,6,7] -1.1/3
    assert [b.tokens for b in best] == [[9, EOS], [9, 5, 7]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert best[1].cum_logprob == pytest.approx(-0.7)
    assert best[1].logprobs[1] == lps(t7=-0.2, t8=-3.0)


def test_ignore_eos_keeps_eos_beams_alive():
    params = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True)
    s = BeamSearch([9], params, EOS, max_model_len=100)
    s.advance([lps(t2=-0.1, t5=-0.5)])
    assert [b.tokens for b in s.live()] == [[9, EOS]] and not s.completed


def test_a_beam_at_max_model_len_ends_by_length():
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    s = BeamSearch([9, 9], params, EOS, max_model_len=3)
    s.advance([lps(t5=-0.5, t6=-1.0)])
    assert s.live() == []  # both at 3 tokens: nothing to extend
    assert [(b.tokens, b.finish_reason) for b in s.result()] == [([9, 9, 5], "length"),
                                                                 ([9, 9, 6], "length")]


def test_step_params_ask_for_2k_logprobs_capped_by_the_vocabulary():
    sp = step_params(BeamSearchParams(beam_width=3, max_tokens=4, temperature=0.5), 512, 20)
    assert (sp.logprobs, sp.max_tokens, sp.temperature) == (6, 1, 0.5)
    assert step_params(BeamSearchParams(beam_width=9, max_tokens=4), 8, 20).logprobs == 8
    with pytest.raises(ValueError, match=r"beam_width=11 .*--max-logprobs 22"):
        step_params(BeamSearchParams(beam_width=11, max_tokens=4), 512, 20)


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=1), "beam_width"),
    (dict(beam_width=True, max_tokens=1), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=1, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=1, length_penalty=math.nan), "length_penalty"),
    (dict(beam_width=2, max_tokens=1, ignore_eos="yes"), "ignore_eos"),
])
def test_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_only_kept_candidates_become_sequences(monkeypatch):
    # each sequence copies its parent's tokens and logprobs: making all 2 * beam_width per
    # beam made a long search's steps O(length * candidates) (seconds over 1,000 steps)
    import kiln.entrypoints.beam_search as bs

    made = []

    class Counted(BeamSearchSequence):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(bs, "BeamSearchSequence", Counted)
    s = BeamSearch([9], BeamSearchParams(beam_width=2, max_tokens=3), EOS, max_model_len=100)
    s.advance([lps(t5=-0.5, t6=-1.0, t7=-1.5, t8=-2.0)])
    made.clear()
    s.advance([lps(t2=-0.1, t5=-0.2, t6=-0.3, t7=-0.4), lps(t5=-0.1, t6=-0.2, t7=-3, t8=-4)])
    assert len(made) == 3  # the eos one finished, and the 2 kept of the 7 others
    assert [b.tokens for b in s.beams] == [[9, 5, 5], [9, 5, 6]]


def test_a_length_penalty_past_float_range_still_ranks():
    # 10 ** 400 overflows a float (OverflowError), 10 ** -400 underflows to 0 (a
    # ZeroDivisionError): either failed the whole search. Ranked as the exact division would.
    assert get_beam_search_score([5] * 10, -2.0, EOS, 400.0) == 0.0
    assert get_beam_search_score([5] * 10, -2.0, EOS, -400.0) == -math.inf

    def ranked(length_penalty, seqs):
        key = create_sort_beams_key_function(EOS, length_penalty)
        return sorted((BeamSearchSequence(tokens=[5] * n, cum_logprob=c) for n, c in seqs),
                      key=key, reverse=True)

    seqs = [(3, -1.0), (20, -9.0), (10, -2.0), (10, -0.5), (2, -1.5), (4, 0.0)]
    # large positive penalty: -|c| / n ** 400, the longest (then the smallest |c|) best
    want = [(4, 0.0), (20, -9.0), (10, -0.5), (10, -2.0), (3, -1.0), (2, -1.5)]
    assert [(len(s.tokens), s.cum_logprob) for s in ranked(400.0, seqs)] == want
    # large negative penalty: -|c| * n ** 400, the shortest (then the smallest |c|) best
    want = [(4, 0.0), (2, -1.5), (3, -1.0), (10, -0.5), (10, -2.0), (20, -9.0)]
    assert [(len(s.tokens), s.cum_logprob) for s in ranked(-400.0, seqs)] == want
