"""`Request`: one sequence as the core sees it (token ids, progress, status, KV block hashes)."""
import enum
import time
from dataclasses import dataclass, field

from kiln.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3  # eos, stop token or stop string
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_REPETITION = 6  # the output repeats a pattern (repetition_detection)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_REPETITION: "repetition"}.get(status)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # vLLM's request priority: lower is served earlier under --scheduling-policy priority
    # (request_queue.py); fcfs ignores it.
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (computed or found by prefix caching).
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Whether the prefix cache's stats counted its prompt: once, whatever sends it back to
    # the queue (a preemption, or a failed step, which counts none).
    prefix_stats_counted: bool = False
    # time.monotonic() when the scheduler first admitted it; kept across preemptions, so the
    # queue time is the wait before its first step (as vLLM's).
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Chained hashes of the request's full blocks (filled by the KV cache manager).
    block_hashes: list = field(default_factory=list)
    # Seeds the hash chain (vLLM's cache_salt): requests share cached blocks only if equal.
    cache_salt: str | None = None
    # The LoRA adapter it runs under (kiln.lora.request.LoRARequest), None: the base model.
    lora_request: object = None
    # Prompt logprobs so far (when asked for), one per prompt token after the first; handed
    # over with the first generated token, after which this is None again.
    prompt_logprobs: list | None = None
    # The grammar of a request with structured_outputs (the scheduler's manager sets it).
    structured_output_request: object = field(default=None, repr=False)
    # Its tokens as a growing numpy array, for the n-gram proposer (kiln/spec_decode/).
    spec_token_buffer: object = field(default=None, repr=False)
    # Its output's repetition so far (kiln/repetition_detection.py), where it asks for the check.
    repetition_tracker: object = field(default=None, repr=False)
    # A draft model's proposals after its last token (the runner's last step; vLLM's name).
    spec_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    def add_prompt_logprobs(self, start: int, entries: list) -> None:
        """Entries predicting prompt tokens start + 1, ...; positions already held (recomputed
        after a preemption) are skipped."""
        have = len(self.prompt_logprobs)
        if start > have:
            raise RuntimeError(f"request {self.request_id!r}: prompt logprobs from position "
                               f"{start} arrived with only {have} before it")
        self.prompt_logprobs.extend(entries[have - start:])

    def take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs, once (None when not asked for or already taken)."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
