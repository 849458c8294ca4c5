"""The messages that cross the executor boundary each step (picklable, no torch).

Scheduler -> runner: `SchedulerOutput`. Runner -> scheduler: `ModelRunnerOutput`.
Core -> engine front: `EngineCoreOutput` per request that produced something this step.
"""
from dataclasses import dataclass, field

import numpy as np

from kiln.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""
    req_id: str
    # Every token the runner must know: prompt + already generated (non-empty after preemption).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: object = None  # kiln.lora.request.LoRARequest, None: the base model
    # KV cache groups 1.. of a hybrid model (kiln/core/kv_cache_groups.py): their tables, each
    # as long as block_ids (group 0's); empty with one group.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since last step."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)
    # per request, groups 1..'s new blocks, as many as new_block_ids' (empty with one group)
    new_group_block_ids: list[list[list[int]]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to run this step (prefill chunk length, or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget (finished, aborted or preempted since last step).
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that sample this step under a grammar, and their token bitmask rows (same
    # order): int32 [len(structured_output_request_ids), ceil(vocab / 32)], bit set = allowed.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding (kiln/spec_decode): req_id -> the draft tokens scheduled after its
    # last token (num_scheduled_tokens counts them); vLLM's name.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class LogprobsLists:
    """Per sampled token: the sampled token then the top-N, with their logprobs and ranks."""
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the distribution


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per req (same order); empty when the request only ran a partial prefill chunk.
    sampled_token_ids: list[list[int]]
    # A list, one per sampled token, where a step sampled several (accepted drafts).
    logprobs: dict[str, LogprobsLists | list[LogprobsLists]] = field(default_factory=dict)
    # req_id -> this step's prompt logprobs (kiln/sample/prompt_logprobs.PromptLogprobsChunk).
    prompt_logprobs: dict = field(default_factory=dict)
    # Pooling runner (kiln/pooling/): req_id -> its pooled hidden state (float32, not yet
    # normalized), for the requests whose prefill ended this step.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # A draft model's proposals after each request's last token, for the next step (vLLM's
    # spec_token_ids; kiln/spec_decode/draft_model_proposer.py).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsLists] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With the request's first token: one entry per prompt token after the first.
    prompt_logprobs: list[LogprobsLists] | None = None
    # time.monotonic() of the request's first scheduling (None if never scheduled); the engine
    # front's queue / prefill / inference times start or end here.
    first_scheduled_time: float | None = None
    # Why the core itself ended the request (an "abort" no client asked for), for the client.
    error: str | None = None
    # A pooling request's pooled hidden state (it finishes with it; no tokens).
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
