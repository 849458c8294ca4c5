"""A Responses API request as the chat request Kiln renders and runs: its instructions and input
items as chat messages, its fields as chat's; what it asks for that Kiln does not do is refused
(400, naming the field), and errors from the chat path name the Responses field the client sent.
"""
import contextlib
import re

from kiln.entrypoints.openai.errors import OpenAIError, request_value
from kiln.entrypoints.openai.openai_limits import check_format_name, check_metadata
from kiln.entrypoints.openai.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
)
from kiln.entrypoints.openai.responses_protocol import ResponseInputItem, ResponsesRequest
from kiln.entrypoints.openai.responses_tools import (
    add_function_call,
    chat_tool_choice,
    chat_tools,
    function_output_message,
)

ROLES = ("user", "system", "developer", "assistant")
# Content parts that are text, and the key holding it (chat_messages reads the same ones).
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# field -> (its off value, why any other is refused). Any-typed fields take null only: 0 or
# false there is no "off" the client meant.
REFUSED = {
    "conversation": (None, "conversations are not stored; send the whole conversation in "
                           "input"),
    "include": ([], "no extra output (logprobs, encrypted reasoning, tool results) is "
                    "included"),
    "top_logprobs": (0, "logprobs are not returned on /v1/responses; use "
                        "/v1/chat/completions"),
    "prompt": (None, "stored prompt templates are not supported; send the text in input"),
    "context_management": (None, "context compaction is not supported"),
}


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what Kiln does not do on this route."""
    for name, (off, why) in REFUSED.items():
        value = getattr(req, name)
        if value is not None and value != off:
            raise OpenAIError(f"{name}={request_value(value)} is refused: {why}; omit it",
                              param=name, code="unsupported_parameter")
    if req.truncation not in (None, "disabled"):
        raise OpenAIError(f"truncation={req.truncation!r} is refused: an input longer than the "
                          "context is refused, never cut; omit it (or give \"disabled\")",
                          param="truncation", code="unsupported_parameter")
    _check_reasoning(req.reasoning)
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise OpenAIError(f"text.verbosity={req.text.verbosity!r} is refused: no template reads "
                          "it; omit it", param="text.verbosity", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed with stream=true",
                          param="stream_options", code="invalid_value")
    check_metadata(req.metadata)
    if req.text is not None and req.text.format is not None:
        check_format_name(req.text.format.name, "text.format.name")


def _content(i: int, content) -> str | list:
    """A message item's content as chat's (text parts), refusing parts that are not text."""
    if content is None:
        raise OpenAIError(f"input[{i}].content is missing: give a string or a list of "
                          "input_text parts", param=f"input[{i}].content", code="invalid_value")
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        key = TEXT_PARTS.get(part.type)
        if key is None:
            raise OpenAIError(f"input[{i}].content[{j}] is a {part.type!r} part, not supported "
                              "(the model is text-only); give input_text parts",
                              param=f"input[{i}].content[{j}].type", code="unsupported_content")
        if getattr(part, key) is None:
            raise OpenAIError(f"input[{i}].content[{j}] is a {part.type!r} part without its "
                              f"{key!r} (a string)", param=f"input[{i}].content[{j}].{key}",
                              code="invalid_value")
        parts.append({"type": "text", "text": getattr(part, key)})
    return parts


def _reasoning_text(i: int, item) -> str:
    """A reasoning item's text (its reasoning_text parts, else its summary's), as the thinking
    of the assistant turn it belongs to."""
    if item.encrypted_content is not None:
        raise OpenAIError(f"input[{i}].encrypted_content is refused: this server never "
                          "encrypts reasoning; send the item's content or summary text",
                          param=f"input[{i}].encrypted_content", code="unsupported_content")
    if isinstance(item.content, str):
        raise OpenAIError(f"input[{i}].content of a reasoning item is a list of reasoning_text "
                          "parts, not a string", param=f"input[{i}].content",
                          code="invalid_value")
    for key in ("content", "summary"):
        for j, part in enumerate(getattr(item, key) or []):
            if part.text is None:
                raise OpenAIError(f"input[{i}].{key}[{j}] has no 'text' (a string)",
                                  param=f"input[{i}].{key}[{j}].text", code="invalid_value")
    return "\n".join(part.text for part in item.content or item.summary or [])


def _check_reasoning(reasoning: dict | None) -> None:
    """reasoning.effort is the template's reasoning_effort (as chat's); a summary is refused."""
    asked = {k: v for k, v in (reasoning or {}).items() if v is not None and k != "effort"}
    if asked:
        name = next(iter(asked))
        raise OpenAIError(f"reasoning.{name}={asked[name]!r} is refused: no reasoning summary "
                          "is written; omit it (reasoning.effort is taken)",
                          param=f"reasoning.{name}", code="unsupported_parameter")
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise OpenAIError(f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got "
                          f"{effort!r:.100}", param="reasoning.effort", code="invalid_value")


def input_messages(req: ResponsesRequest, history: list[ResponseInputItem] = ()
                   ) -> tuple[list[ChatMessage], list[str]]:
    """(the chat messages, what each stands for: "instructions", "input[i]" or
    "previous_response_id"). `history`: the items of the response previous_response_id names,
    before the input.

    A function_call item is a tool call of the assistant turn (parallel calls, and the
    message before them, one turn); a function_call_output item the tool message. A reasoning
    item (a response's output sent back as history, as OpenAI's and vLLM's
    conversation examples do) is the reasoning_content of the assistant message item after
    it, or an assistant turn of its own (vLLM's) when none follows."""
    messages, sources = [], []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
        sources.append("instructions")
    if not req.input:
        raise OpenAIError("input is empty: give a string or at least one message item",
                          param="input", code="invalid_value")
    reasoning = None  # (its item's place, its text): waiting for the assistant message

    def alone():  # the waiting reasoning as an assistant turn of its own
        messages.append(ChatMessage(role="assistant", content="", reasoning_content=reasoning[1]))
        sources.append(reasoning[0])

    # history: checked when it was sent; what it becomes names where it came from
    items = [(None, item) for item in history] + list(enumerate(req.input))
    calls = set()  # the call_ids of the function_call items so far
    for i, item in items:
        where = "previous_response_id" if i is None else f"input[{i}]"
        if item.type == "function_call":
            if reasoning is not None:  # the thinking before the call: the calling turn's
                alone()
                reasoning = None
            add_function_call(messages, sources, i, item, where)
            calls.add(item.call_id)
            continue
        if item.type == "function_call_output":
            messages.append(function_output_message(i, item, calls))
            sources.append(where)
            continue
        if item.type == "reasoning":
            if reasoning is not None:
                alone()
            reasoning = (where, _reasoning_text(i, item))
            continue
        if item.type not in (None, "message"):
            raise OpenAIError(f"input[{i}] is a {item.type!r} item, not supported: give message "
                              "items (role and content)", param=f"input[{i}].type",
                              code="unsupported_content")
        if item.role not in ROLES:
            raise OpenAIError(f"input[{i}].role must be one of {list(ROLES)}, got {item.role!r}",
                              param=f"input[{i}].role", code="invalid_value")
        thinking = None
        if reasoning is not None:
            if item.role == "assistant":
                thinking = reasoning[1]
            else:
                alone()
            reasoning = None
        messages.append(ChatMessage(role=item.role, content=_content(i, item.content),
                                    reasoning_content=thinking))
        sources.append(where)
    if reasoning is not None:
        alone()
    return messages, sources


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request the answer is rendered, sampled and constrained by."""
    fields = dict(messages=messages, model=req.model, temperature=req.temperature,
                  top_p=req.top_p, max_completion_tokens=req.max_output_tokens,
                  stream=req.stream, user=req.user, request_id=req.request_id,
                  priority=req.priority, cache_salt=req.cache_salt)
    tools = chat_tools(req.tools)
    choice = chat_tool_choice(req.tool_choice)
    if tools:
        fields.update(tools=tools, tool_choice=choice,
                      parallel_tool_calls=req.parallel_tool_calls is not False)
    elif choice not in (None, "auto", "none"):  # "auto" and "none" choose among no tools
        raise OpenAIError(f"tool_choice={request_value(req.tool_choice)} needs tools: give "
                          "tools or drop tool_choice", param="tool_choice", code="invalid_value")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        schema = None if fmt.schema_ is None else {"schema": fmt.schema_}
        if schema is not None and fmt.name is not None:  # null: no name (checked above)
            schema["name"] = fmt.name
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise OpenAIError("text.format json_schema needs its schema", param="text.format",
                              code="invalid_value")
        fields["response_format"] = ResponseFormat(type=fmt.type, json_schema=schema)
    return ChatCompletionRequest(**fields)


# Chat's names for what a Responses request calls otherwise.
_RENAMED = [(re.compile(r"(?<![\w-])max_completion_tokens(?![\w-])"), "max_output_tokens"),
            (re.compile(r"(?<![\w-])(tools\[\d+\])\.function\."), r"\1."),
            (re.compile(r"(?<![\w-])response_format(?![\w-])"), "text.format")]
_MESSAGE = re.compile(r"(?<![\w-])messages(\[(\d+)\](\.content)?)?")


def responses_terms(text: str | None, sources: list[str]) -> str | None:
    """A chat error's field names as the Responses request has them: messages[k] is
    sources[k] (the instructions or an input item), max_completion_tokens is
    max_output_tokens, response_format is text.format."""
    if text is None:
        return None
    for pattern, name in _RENAMED:
        text = pattern.sub(name, text)

    def message(m: re.Match) -> str:
        if m.group(2) is None:
            return "input"
        k = int(m.group(2))
        if k >= len(sources):
            return m.group(0)
        if sources[k] == "instructions":  # the instructions' system message: no parts
            return "instructions"
        return f"{sources[k]}{m.group(3) or ''}"
    return _MESSAGE.sub(message, text)


@contextlib.contextmanager
def in_responses_terms(sources: list[str]):
    """Errors raised inside name the Responses request's fields (see responses_terms)."""
    try:
        yield
    except OpenAIError as e:
        e.message = responses_terms(e.message, sources)
        e.param = responses_terms(e.param, sources)
        e.args = (e.message,)
        raise
