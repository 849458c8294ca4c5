"""Pydantic models of the bodies Kiln's OpenAI server sends back: completions, chat (whole and
streamed), models, tokenization and errors. The requests they answer are protocol.py's.
"""
import time
from typing import Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from kiln.entrypoints.openai.protocol_base import OpenAIBase


class PromptTokenUsageInfo(OpenAIBase):
    cached_tokens: int | None = None


class CompletionTokenUsageInfo(OpenAIBase):
    reasoning_tokens: int | None = None


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Only with --enable-prompt-tokens-details (as vLLM): prompt tokens the prefix cache held.
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    # Only with --reasoning-parser, on a chat's whole usage (as vLLM): its thinking's tokens.
    completion_tokens_details: CompletionTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _no_null_details(self, handler):  # no null details key when the flag is off
        data = handler(self)
        for key in ("prompt_tokens_details", "completion_tokens_details"):
            if data.get(key, 0) is None:
                del data[key]
        return data


def make_usage(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None = None,
               reasoning_tokens: int | None = None) -> UsageInfo:
    """`cached_tokens`, `reasoning_tokens`: None leaves their details out."""
    details = None if cached_tokens is None else PromptTokenUsageInfo(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=details,
                     completion_tokens_details=None if reasoning_tokens is None else
                     CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens))


class CompletionLogprobs(OpenAIBase):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(OpenAIBase):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (the first has none): token id -> its logprob, rank and text, as vLLM's.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # return_token_ids (vLLM's): in a stream, prompt_token_ids only in a choice's first chunk.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int  # when the request came in (unix s), in every chunk and whole: as vLLM's
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


class FunctionCall(OpenAIBase):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBase):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _same_reasoning(message):
    """`reasoning`, vLLM's name for reasoning_content since 0.11 (what its clients read), holds
    the same text."""
    message.reasoning = message.reasoning_content
    return message


class ChatResponseMessage(OpenAIBase):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None  # vLLM's name for it since 0.11 (_same_reasoning)
    _reasoning_too = model_validator(mode="after")(_same_reasoning)


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # when the request came in (unix s), in every chunk and whole: as vLLM's
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class StreamDelta(OpenAIBase):
    """A streamed delta: fields it does not carry are left out, not sent as null, as OpenAI
    and vLLM stream them. The openai SDK's stream accumulator copies each delta's keys over
    what it has gathered: a later tool-call piece's `"type": null` erased the first one's
    "function" and failed its check."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(StreamDelta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(StreamDelta):
    """A streamed piece of a tool call: the first carries id, type and name, the rest pieces
    of the arguments' JSON text (concatenated, they are the whole arguments)."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(StreamDelta):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # vLLM's name for it since 0.11 (_same_reasoning)
    _reasoning_too = model_validator(mode="after")(_same_reasoning)


class ChatStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int  # when the request came in (unix s), in every chunk and whole: as vLLM's
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kiln"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
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
