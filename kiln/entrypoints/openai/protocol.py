"""Pydantic models of the OpenAI HTTP API that Kiln serves (plus vLLM's sampling extras).

Unknown request fields are ignored, as OpenAI-compatible servers do; wrong types fail validation.
"""
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

# OpenAI's limit on choices per prompt; each is a sequence in the engine, built at once.
MAX_N = 128


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """An explicit null takes the field's default, as OpenAI and vLLM treat it (clients
        send `"n": null`); a required field stays required."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required()}
        return data


# ---- requests -------------------------------------------------------------------------------
class StreamOptions(OpenAIBase):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIBase):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# Strict: JSON true / false are no token ids.
PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(OpenAIBase):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBase):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ResponseFormat(OpenAIBase):
    type: str = "text"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    # vLLM extras for the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # on top of what the template writes (BOS, usually)


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in chat completions, so counts agree
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def make_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(OpenAIBase):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBase):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIBase):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIBase):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kiln"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBase):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBase):
    prompt: str


class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo
