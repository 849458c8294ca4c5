"""The scheduler's side of a draft model: the proposals the runner left on a request are its
next step's drafts (cut as n-gram's are), and the draft's lookahead slots are held past the
step's tokens without being hashed into the prefix cache."""
from kiln.config.speculative_config import SpeculativeConfig
from kiln.core.kv_cache_manager import KVCacheManager
from kiln.core.request import Request
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.scheduling import (
    SpecDecodeScheduling,
    draft_lag,
    draft_room,
    target_room,
)

DRAFT = SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=3)


def decoding(prompt: int, out: int, **params) -> Request:
    request = Request("r", list(range(3, 3 + prompt)), SamplingParams(**params))
    request.output_token_ids.extend([7] * out)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_drafts_are_the_runners_proposals_cut_to_budget_length_and_max_tokens():
    sd = SpecDecodeScheduling(DRAFT)
    request = decoding(10, 2, max_tokens=20)
    request.spec_token_ids = [4, 5, 6]
    assert sd.drafts(request, budget=100, max_model_len=100) == [4, 5, 6]
    assert sd.drafts(request, budget=3, max_model_len=100) == [4, 5]
    # 12 tokens: a 13th and 14th fit; the second is the token sampled after the draft
    assert sd.drafts(request, budget=100, max_model_len=14) == [4]
    assert sd.drafts(request, budget=100, max_model_len=13) == []
    assert sd.drafts(decoding(10, 17, max_tokens=20), 100, 100) == []  # none proposed
    request = decoding(10, 17, max_tokens=20)
    request.spec_token_ids = [4, 5, 6]
    assert sd.drafts(request, 100, 100) == [4, 5]  # the 20th token is the last
    request.num_computed_tokens -= 3  # a prefill (after preemption): no drafts
    assert sd.drafts(request, 100, 100) == []


def test_the_most_drafts_that_still_fit():
    """The target keeps the accepted drafts and one token more: a draft that only an extra token
    past max_model_len or max_tokens could follow is never worth verifying (as vLLM's scheduler,
    which runs no position past max_model_len - 2). The draft's own length bounds the position
    it proposes from: known + k - 2 for a draft model, one less for an EAGLE head (its position
    i reads token i + 1), which so drafts once more at the boundary."""
    assert target_room(10, 2, None, 14) == 3  # 4 more tokens: 3 drafts and the sampled one
    assert target_room(10, 2, 5, 100) == 2 and target_room(10, 5, 5, 100) == -1
    assert draft_room(known=20, draft_end=24, lag=0) == 5  # last from position 23
    assert draft_room(20, 24, lag=1) == 6
    assert draft_room(25, 24, lag=1) == 1 and draft_room(25, 24, lag=0) == 0
    eagle = SpeculativeConfig(method="eagle", model="m", num_speculative_tokens=3)
    assert draft_lag(eagle) == 1 and draft_lag(DRAFT) == 0


def test_lookahead_is_k_within_the_context_and_none_for_ngram():
    sd = SpecDecodeScheduling(DRAFT)
    assert sd.lookahead(10, 4, 100) == 3
    assert sd.lookahead(10, 4, 16) == 2 and sd.lookahead(10, 6, 16) == 0
    ngram = SpecDecodeScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert ngram.lookahead(10, 4, 100) == 0


def test_lookahead_slots_are_held_but_never_hashed():
    kv = KVCacheManager(4, 10)
    request = Request("a", list(range(3, 11)), SamplingParams())  # 8 tokens: 2 blocks
    assert len(kv.allocate_slots(request, 4, num_lookahead_tokens=4)) == 2  # 4 + 4 slots
    # the first chunk's block only: the second holds prompt tokens not computed yet
    other = Request("b", list(range(3, 11)), SamplingParams())
    assert kv.get_computed_blocks(other)[1] == 4
