"""The scheduler's side of a draft model: the proposals the runner left on a request are its
next step's drafts (cut as n-gram's are), and the draft's lookahead slots are held past the
step's tokens without being hashed into the prefix cache."""
import copy
import dataclasses
from types import SimpleNamespace

from kiln.config.speculative_config import SpeculativeConfig
from kiln.core.kv_cache_manager import KVCacheManager
from kiln.core.request import Request
from kiln.core.scheduler import Scheduler
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.scheduling import (
    SpecDecodeScheduling,
    draft_lag,
    draft_room,
    target_room,
)
from tests.core.doubles import make_config, make_request

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


def with_draft_len(config: SpeculativeConfig, draft_len: int) -> SpeculativeConfig:
    """A copy with the draft's (capped) length on its model config, as KilnConfig resolves it."""
    config = copy.copy(config)
    object.__setattr__(config, "draft_model_config", SimpleNamespace(max_model_len=draft_len))
    return config


def test_lookahead_only_for_requests_that_draft_after_the_step():
    """Past the step's tokens the draft writes only the K/V of what it proposes after it (the
    last from position known + k - 2 - lag, every draft accepted): k slots for a draft model,
    k - 1 for an EAGLE head, and none for a request it will not draft for, which held k slots
    each step (more blocks, and earlier preemptions, for nothing)."""
    sd = SpecDecodeScheduling(with_draft_len(DRAFT, 40))
    request = decoding(10, 4, max_tokens=20)  # 14 tokens; verifies 3 drafts: 13 + 4
    assert sd.lookahead(request, 13, 4, 100, limit=100) == 3
    assert sd.lookahead(request, 13, 4, 100, limit=19) == 2  # what the cache holds
    # 18 known at most after the step: the context's end leaves room for 1 draft, then none
    assert sd.lookahead(request, 13, 4, 20, 100) == 1
    assert sd.lookahead(request, 13, 4, 19, 100) == 0
    assert sd.lookahead(decoding(10, 4, max_tokens=9), 13, 4, 100, 100) == 0  # at max_tokens
    # the draft's length: the 18th token drafts once from position 17, not past it
    assert SpecDecodeScheduling(with_draft_len(DRAFT, 18)).lookahead(
        request, 13, 4, 100, 100) == 1
    assert SpecDecodeScheduling(with_draft_len(DRAFT, 17)).lookahead(
        request, 13, 4, 100, 100) == 0
    prompt = Request("p", list(range(3, 23)), SamplingParams())  # 20 tokens, in 2 chunks
    assert sd.lookahead(prompt, 0, 16, 100, 100) == 0  # samples nothing
    assert sd.lookahead(prompt, 16, 4, 100, 100) == 3
    request.structured_output_request = object()  # decoded token by token
    assert sd.lookahead(request, 13, 4, 100, 100) == 0
    eagle = SpeculativeConfig(method="eagle", model="m", num_speculative_tokens=3)
    eagle_sd = SpecDecodeScheduling(with_draft_len(eagle, 40))
    assert eagle_sd.lookahead(prompt, 16, 4, 100, 100) == 2
    # drafts once at its end, from a position within the step
    assert SpecDecodeScheduling(with_draft_len(eagle, 20)).lookahead(
        prompt, 16, 4, 100, 100) == 0
    ngram = SpecDecodeScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert ngram.lookahead(prompt, 16, 4, 100, 100) == 0


def test_a_request_past_the_drafts_length_holds_no_lookahead_blocks():
    config = make_config(block_size=4)
    spec = SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=3)
    object.__setattr__(spec, "draft_model_config",
                       dataclasses.replace(config.model_config, max_model_len=12))
    sched = Scheduler(dataclasses.replace(config, speculative_config=spec), 64)
    for rid, n in (("short", 8), ("long", 12)):
        sched.add_request(make_request(rid, range(10, 10 + n)))
    sched.schedule()
    held = {rid: len(sched.kv_cache_manager.get_block_ids(rid)) for rid in ("short", "long")}
    # 8 tokens and 3 drafts after them: 11 slots; 12 tokens, at the draft's end: no drafts
    assert held == {"short": 3, "long": 3}


def test_lookahead_slots_are_held_but_never_hashed():
    kv = KVCacheManager(4, 10)
    request = Request("a", list(range(3, 11)), SamplingParams())  # 8 tokens: 2 blocks
    assert len(kv.allocate_slots(request, 4, num_lookahead_tokens=4)) == 2  # 4 + 4 slots
    # the first chunk's block only: the second holds prompt tokens not computed yet
    other = Request("b", list(range(3, 11)), SamplingParams())
    assert kv.get_computed_blocks(other)[1] == 4
