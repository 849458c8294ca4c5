"""The sampler's token bitmask: unpacking matches a per-bit reference, only the listed rows are
masked, greedy and random draws stay inside the mask, logprobs are those of the masked
distribution, and a grammar that allows only stop tokens wins over min_tokens."""
import numpy as np
import torch

from kiln.sample.grammar_mask import apply_token_bitmask, bitmask_rows, unpack_bitmask
from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

V = 100


def pack(allowed: list[set[int]], vocab: int = V) -> torch.Tensor:
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            out[r, t // 32] |= 1 << (t % 32)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32))


def test_unpack_matches_bits_including_the_sign_bit():
    allowed = [{0, 31, 32, 63, 99}, set(range(V))]
    got = unpack_bitmask(pack(allowed), V)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in got] == allowed
    # A mask narrower than the logits allows nothing past its end.
    assert not unpack_bitmask(pack([{1}], 32), V)[0, 32:].any()


def test_only_listed_rows_are_masked_and_the_input_is_untouched():
    logits = torch.randn(3, V)
    before = logits.clone()
    out = apply_token_bitmask(logits, pack([{7, 8}]), torch.tensor([1]))
    assert torch.equal(logits, before)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == {7, 8}


def test_bitmask_rows_follow_the_sampler_order():
    mask = np.arange(6, dtype=np.int32).reshape(3, 2)
    rows, masks = bitmask_rows(["a", "b", "c"], ["c", "x", "a"], mask)
    assert rows.tolist() == [2, 0] and masks.tolist() == [[0, 1], [4, 5]]
    assert bitmask_rows(["a"], [], None) is None


def _meta(params, **kw):
    return build_sampling_metadata(params, [[1]] * len(params), [[]] * len(params),
                                   [None] * len(params), torch.Generator().manual_seed(0), V,
                                   torch.device("cpu"))


def test_sampler_stays_in_the_mask_with_consistent_logprobs():
    allowed = [{3, 50, 97}, {11}, {20, 21}]
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.5, logprobs=3)]
    for seed in range(20):
        logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed)) * 3
        meta = _meta(params + [SamplingParams(temperature=0)])
        meta.grammar_rows = torch.tensor([0, 1, 2])
        meta.grammar_bitmask = pack(allowed)
        out = Sampler()(logits, meta)
        tokens = out.sampled_token_ids.tolist()
        assert all(t in a for t, a in zip(tokens, allowed)), tokens
        assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t])
        assert tokens[3] == int(logits[3].argmax())  # unconstrained row untouched
        lp = out.logprobs
        assert torch.isfinite(lp[:3, 0]).all() and out.sampled_ranks[0] == 1
        # logprobs come from the masked distribution: the allowed tokens hold all the mass.
        masked = logits[0].masked_fill(~unpack_bitmask(pack(allowed[:1]), V)[0], -torch.inf)
        assert torch.allclose(lp[0, 0], masked.log_softmax(0)[tokens[0]])


def test_grammar_that_allows_only_stop_wins_over_min_tokens():
    params = [SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[9])]
    params[0].update_from_tokenizer(None, V)
    meta = _meta(params)
    meta.grammar_rows = torch.tensor([0])
    meta.grammar_bitmask = pack([{9}])
    assert Sampler()(torch.randn(1, V), meta).sampled_token_ids.tolist() == [9]


def test_the_grammar_wins_over_allowed_token_ids_and_bad_words_that_leave_it_nothing():
    """A grammar row whose allowed_token_ids / banned tokens leave no token the grammar allows
    samples under the grammar alone (it sampled token 0, outside both, and the request then ran
    unconstrained); a row with no grammar keeps its own masks."""
    params = [SamplingParams(temperature=0, allowed_token_ids=[7]),
              SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0, allowed_token_ids=[7, 8])]
    for p in params:
        p.update_from_tokenizer(None, V)
    params[1].bad_words_token_ids = [[5]]  # a one-token bad word: always banned
    meta = _meta(params)
    meta.grammar_rows = torch.tensor([0, 1])
    meta.grammar_bitmask = pack([{5, 6}, {5}])
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    tokens = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert tokens[0] == max((5, 6), key=lambda t: logits[0, t]) and tokens[1] == 5
    assert tokens[2] == max((7, 8), key=lambda t: logits[2, t])
