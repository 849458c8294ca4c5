"""The bodies /v1/responses sends back: the response object (whole, and inside the stream's
created / in_progress / completed events), its output items (a reasoning item with
--reasoning-parser, then the assistant message, then function calls: responses_tools.py) and
usage, in OpenAI's shapes; and the stream's server-sent events (`event: <type>`, then the JSON
with the same type and a sequence_number).
"""
import json
import secrets
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kiln.entrypoints.openai.protocol_base import OpenAIBase
from kiln.entrypoints.openai.responses_tools import FunctionCallItem


def item_id(prefix: str) -> str:
    """An output item's id: msg_..., rs_... (OpenAI's prefixes)."""
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputText(OpenAIBase):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(OpenAIBase):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputMessage(OpenAIBase):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(OpenAIBase):
    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(OpenAIBase):
    cached_tokens: int = 0  # prompt tokens the prefix cache held


class OutputTokensDetails(OpenAIBase):
    reasoning_tokens: int = 0  # counted with --reasoning-parser (think tags as single tokens)


class ResponseUsage(OpenAIBase):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def make_response_usage(input_tokens: int, output_tokens: int, cached: int,
                        reasoning: int | None) -> ResponseUsage:
    return ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                         total_tokens=input_tokens + output_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning
                                                                   or 0))


class IncompleteDetails(OpenAIBase):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(OpenAIBase):
    id: str
    object: Literal["response"] = "response"
    created_at: int  # when the request came in (unix s)
    status: Literal["completed", "incomplete", "in_progress", "cancelled", "failed", "queued"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = False  # kept (responses_store.py): only with KILN_ENABLE_RESPONSES_API_STORE
    background: bool = False
    temperature: float | None = None  # the ones sampled with (the model's defaults if unset)
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)  # the request's, as sent
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseStreamEvent(OpenAIBase):
    """A stream event as /openapi.json states it: its type, its place in the stream, and the
    fields that type carries (OpenAI's: response, item, part, delta, text, ...)."""
    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class EventWriter:
    """Numbers a stream's events from 0 and writes each as a server-sent event."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, type: str, **fields) -> str:
        data = {"type": type, "sequence_number": self.sequence_number}
        for k, v in fields.items():
            data[k] = v.model_dump() if isinstance(v, OpenAIBase) else v
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data)}\n\n"
