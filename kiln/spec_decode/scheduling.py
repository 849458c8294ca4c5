"""The scheduler's side of speculative decoding: which drafts a decoding request runs this step
(n-gram: proposed here; a draft model: proposed by the runner last step, kept on the request),
and, once the runner verified them, how far the request really advanced.

A drafted request is scheduled 1 + k tokens (KV slots for them all); its num_computed_tokens
then moves back by the rejected drafts, whose slots the next steps overwrite. The prefix cache
only hashes blocks of known tokens (KVCacheManager._cache_full_blocks stops at num_tokens), so
drafts, which are never known tokens, are never hashed.
"""
from dataclasses import dataclass, field

import numpy as np

from kiln.config.speculative_config import SpeculativeConfig
from kiln.core.request import Request
from kiln.spec_decode.ngram_proposer import propose_ngram


@dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters, totals since the engine started."""
    num_drafts: int = 0  # drafted request-steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


def max_lookahead(config: SpeculativeConfig | None) -> int:
    """The most KV slots a step holds past its tokens (a draft model's or EAGLE head's k;
    0 for n-grams, which write nothing past the step)."""
    if config is None or not config.runner_proposes:
        return 0
    return config.num_speculative_tokens


def draft_lag(config: SpeculativeConfig) -> int:
    """Positions the draft runs behind the tokens: an EAGLE head's position i reads token i + 1
    (and the target's state at i), so it proposes the token at `known` from position known - 2;
    a draft model from known - 1, its own last token."""
    return 1 if config.is_eagle else 0


def target_room(num_tokens: int, num_output_tokens: int, max_tokens: int | None,
                max_model_len: int) -> int:
    """The most drafts worth verifying after a request's `num_tokens` tokens: the target keeps
    the accepted ones and samples one more, and all must fit max_model_len and max_tokens; a
    further draft could only be cut off (vLLM's scheduler keeps a step's positions below
    max_model_len - 1). May be <= 0: none."""
    room = max_model_len - num_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens)
    return room - 1


def draft_room(known, draft_end, lag: int):
    """The most drafts the draft can propose after `known` tokens when it runs positions below
    `draft_end` only (its length, the KV slots held): its k-th comes from position known + k -
    2 - lag (draft_lag). May be <= 0: none. Takes numpy arrays too."""
    return draft_end + 1 + lag - known


class SpecDecodeScheduling:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # drafts proposed by the runner's draft model or EAGLE head (kept on the request)
        self.from_runner = config.runner_proposes
        self.lag = draft_lag(config)
        draft = config.draft_model_config  # its capped length (None: not resolved, no cap)
        self.draft_len = None if draft is None else draft.max_model_len
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    def drafts(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """The drafts to run after a decoding request's last token ([] for a prefill, or
        a request under a grammar: its tokens are checked one by one as they are accepted)."""
        if (request.num_computed_tokens != request.num_tokens - 1
                or request.structured_output_request is not None):
            return []
        c = self.config
        k = min(c.num_speculative_tokens, budget - 1,
                target_room(request.num_tokens, request.num_output_tokens,
                            request.sampling_params.max_tokens, max_model_len))
        if k <= 0:
            return []
        if self.from_runner:
            return list(request.spec_token_ids[:k])
        return propose_ngram(token_array(request), c.prompt_lookup_min, c.prompt_lookup_max, k)

    def lookahead(self, request: Request, num_computed: int, num_new: int, max_model_len: int,
                  limit: int) -> int:
        """KV slots past the step's tokens that the runner's draft writes after the step: the
        K/V of the drafts it proposes then, reckoned for every draft accepted (which puts the
        last proposal furthest). None for a request that will not draft: a prefill chunk that
        samples nothing, one under a grammar, one past the draft's length or at the end of
        max_model_len or max_tokens. `limit`: the most slots a request may hold."""
        end = num_computed + num_new
        if (not self.from_runner or end < request.num_tokens
                or request.structured_output_request is not None):
            return 0
        known = end + 1
        k = min(self.config.num_speculative_tokens,
                target_room(known, request.num_output_tokens + known - request.num_tokens,
                            request.sampling_params.max_tokens, max_model_len))
        if self.draft_len is not None:
            k = min(k, draft_room(known, self.draft_len, self.lag))
        # its last proposal comes from position known + k - 2 - lag: end + k - 1 - lag
        return max(0, min(k - self.lag, limit - end))

    def settle(self, request: Request, drafts: list[int], sampled: list[int]) -> None:
        """After the runner verified `drafts`: it sampled the accepted ones and one more. The
        rejected drafts' positions are not computed (their KV slots are rewritten later)."""
        if not sampled:
            return
        accepted = len(sampled) - 1
        request.num_computed_tokens -= len(drafts) - accepted
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.num_accepted_tokens_per_pos[pos] += 1


def token_array(request: Request) -> np.ndarray:
    """The request's prompt + output tokens as an int64 array, kept on the request and
    extended by the new output tokens only (rebuilding it from the lists cost O(context) per
    request and step). Output tokens are only ever appended, preemption included."""
    buf = request.spec_token_buffer
    n = request.num_tokens
    if buf is None:
        buf = np.empty(max(2 * n, 64), dtype=np.int64)
        buf[:request.num_prompt_tokens] = request.prompt_token_ids
        have = request.num_prompt_tokens
    else:
        buf, have = buf
    if have < n:
        if n > buf.size:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        buf[have:n] = request.output_token_ids[have - request.num_prompt_tokens:]
    request.spec_token_buffer = (buf, n)
    return buf[:n]
