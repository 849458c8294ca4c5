"""What the public API returns: `RequestOutput` per request, one `CompletionOutput` per sample.

Field names follow vLLM so callers can switch engines by changing an import.
"""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability, its 1-based rank and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then the prompt token's
# Logprob and the top-N.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Why the engine ended it with "abort" (its grammar allowed no token, the KV cache can never
    # hold it); None when it finished otherwise or a caller aborted it.
    error: str | None = None
    lora_request: object = None  # vLLM's: the LoRARequest that wrote it (LLM.generate sets it)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps the core recorded for a request, in time.monotonic() seconds (as arrival)."""
    first_scheduled_time: float | None = None  # earliest over the request's samples
    # Each sample's own, by sample index (None until scheduled): the samples of an n > 1
    # request are scheduled apart, and the server's metrics time each sample from its own.
    sample_first_scheduled_times: tuple[float | None, ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set
    metrics: RequestMetrics | None = None  # once the core has scheduled the request
    lora_request: object = None  # vLLM's: the request's LoRARequest (LLM.generate sets it)

    # vLLM's fields for what Kiln does not serve (encoder-decoder and multimodal models, KV
    # transfer): always empty, so code ported from vLLM reads them as vLLM gives them for a
    # text-only model, not as an AttributeError.

    @property
    def encoder_prompt(self) -> None:
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        return None

    @property
    def multi_modal_placeholders(self) -> dict:
        return {}

    @property
    def kv_transfer_params(self) -> None:
        return None
