"""The samples of an n > 1 request: one child core request per sample (vLLM's ParentRequest).

The front end sends the parent once, with the children's ids; the core makes the children here,
so a big shared field (a whole-vocabulary logit_bias, allowed_token_ids, bad words' ids) crosses
the process boundary and is decoded once, not once per sample.
"""
import copy
from collections.abc import Sequence

from kiln.core.request import Request
from kiln.sampling_params import SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of sample `index` of an n > 1 request: n=1, and distinct seeds if seeded.
    A shallow copy, as vLLM's: the samples share the lists nothing changes (bad_words and their
    ids, stop strings, logit_bias), which a deep copy per sample rebuilt on the engine thread
    (1,000 bad words at n=128 held every stream for seconds)."""
    child = copy.copy(params)
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def child_requests(parent: Request, child_ids: Sequence[str]) -> list[Request]:
    """The core requests of `parent`'s samples, sample i named child_ids[i]; each its own
    prompt list (the core's requests never share mutable state but their params' fields), and
    the parent's arrival time and priority, so the samples queue together."""
    params = parent.sampling_params
    if len(child_ids) != params.n:
        raise ValueError(f"request {parent.request_id!r} has n={params.n} but "
                         f"{len(child_ids)} child ids")
    return [Request(request_id=cid, prompt_token_ids=list(parent.prompt_token_ids),
                    sampling_params=child_params(params, i), arrival_time=parent.arrival_time,
                    cache_salt=parent.cache_salt, priority=parent.priority,
                    lora_request=parent.lora_request)
            for i, cid in enumerate(child_ids)]
