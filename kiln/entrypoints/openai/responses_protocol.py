"""The request body of OpenAI's Responses API (POST /v1/responses), as Kiln takes it: what vLLM
serves for a text model (input as text or message, reasoning, function_call and
function_call_output items, instructions, max_output_tokens, temperature, top_p, stream,
text.format, function tools and tool_choice, store, previous_response_id and background,
metadata, user) plus vLLM's request_id, priority and cache_salt. Every other field of OpenAI's
is here too, so that responses_input.py refuses it (400, naming it) rather than ignoring it.
"""
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictBool, model_validator

from kiln.entrypoints.openai.openai_limits import FORMAT_NAME_SCHEMA, METADATA_SCHEMA
from kiln.entrypoints.openai.protocol_base import (
    JsonFloat,
    JsonInt,
    RequestBase,
    RequestPart,
    warn_ignored_fields,
)
from kiln.logger import init_logger

logger = init_logger(__name__)

# OpenAI's fields that change nothing a local model writes: taken without a warning.
_NO_EFFECT_FIELDS = frozenset({"service_tier", "prompt_cache_key", "safety_identifier",
                               "prompt_cache_retention"})


class ResponseContentPart(RequestPart):
    """A part of a message item's content: input_text / output_text (its text), refusal (an
    assistant history's), or a kind the server refuses (input_image, input_file, ...)."""
    type: str
    text: str | None = None
    refusal: str | None = None


class ResponseInputItem(RequestPart):
    """An item of `input`: a message (type "message" or none, a role and its content), a
    reasoning item (a response's, sent back as history: its reasoning_text content or its
    summary), a function_call (call_id, name, arguments) or function_call_output (call_id,
    output) item, or an item the server refuses by its type (item_reference, ...)."""
    type: str | None = None  # none (or null): a message
    role: str | None = None
    content: str | list[ResponseContentPart] | None = None
    id: str | None = None  # an output item sent back as history carries its own
    status: str | None = None
    summary: list[ResponseContentPart] | None = None  # a reasoning item's (summary_text parts)
    encrypted_content: str | None = None  # a reasoning item's: refused
    call_id: str | None = None  # a function_call's, and the function_call_output answering it
    name: str | None = None  # a function_call's function
    arguments: str | None = None  # a function_call's (JSON text)
    output: Any = None  # a function_call_output's: a string (or input_text parts)


def _text_as_message(value):
    """A string input is one user message: validated as such, a bad item's error names its
    place (input[0].content), where a union with str named only `input`."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def _string_or_items(schema: dict) -> None:
    items = dict(schema)
    title = items.pop("title", None)
    schema.clear()
    schema.update(anyOf=[{"type": "string"}, items], **({"title": title} if title else {}))


# The input: text, or message items.
ResponsesInput = Annotated[list[ResponseInputItem], BeforeValidator(_text_as_message),
                           Field(json_schema_extra=_string_or_items)]


class TextFormat(RequestBase):
    """text.format: "text", "json_object", or "json_schema" with the schema beside the type
    (not under a json_schema key, as chat's response_format has it)."""
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, json_schema_extra=FORMAT_NAME_SCHEMA)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    model_config = {**RequestBase.model_config, "populate_by_name": True}


class TextConfig(RequestBase):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless "medium" (no template reads it)


class ResponsesRequest(RequestBase):
    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data):
        warn_ignored_fields(logger, cls, data, _NO_EFFECT_FIELDS)
        return data

    model: str | None = None
    input: ResponsesInput
    instructions: str | None = None  # a system message before the input
    max_output_tokens: JsonInt | None = None  # null: up to the context's end
    temperature: JsonFloat | None = None
    top_p: JsonFloat | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no random padding here
    user: str | None = None  # echoed
    metadata: dict[str, str] | None = Field(None, json_schema_extra=METADATA_SCHEMA)  # echoed
    text: TextConfig | None = None
    # OpenAI's default is true: kept with KILN_ENABLE_RESPONSES_API_STORE=1 (responses_store.py);
    # without it nothing is kept and the response says store false, as vLLM's.
    store: StrictBool | None = None
    previous_response_id: str | None = None  # needs the store
    # Function tools in the Responses API's flat shape; built-in tools refused
    # (responses_tools.py), checked by hand to name tools[i].type.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: JsonInt | None = None  # at most this many calls (tool_plan.call_limit)
    # Run detached, polled from the store (responses_background.py): needs the store
    background: StrictBool | None = None
    # Refused unless off / empty (responses_input.refuse_unsupported):
    conversation: Any = None
    include: list[Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: JsonInt | None = None
    prompt: Any = None
    context_management: Any = None
    # vLLM's extras
    request_id: str | None = None  # names the response (resp_<request_id>)
    # Within what a double holds exactly: schema tools (schemathesis) read the bounds as
    # floats and drew past an int64's 2**63
    priority: JsonInt = Field(0, ge=-2**53, le=2**53)
    cache_salt: str | None = None
