"""Function tools on /v1/responses, run through chat's tool machinery (tool_plan.py): the
Responses API's flat tools (`{"type": "function", "name", "description", "parameters",
"strict"}`) and tool_choice as chat's, the function_call / function_call_output items sent back
as history as the assistant's tool calls and tool messages, and the calls read from the answer
as function_call output items. Built-in tools (web_search, file_search, mcp, ...) are refused,
naming tools[i].type.
"""
import secrets
from typing import Any, Literal

from pydantic import Field, StrictBool, ValidationError

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import (
    ChatCompletionTool,
    ChatMessage,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)
from kiln.entrypoints.openai.protocol_base import OpenAIBase, RequestBase
from kiln.entrypoints.openai.response_models import ToolCall


class FunctionTool(RequestBase):
    """A Responses API function tool: chat's function, flat beside its type."""
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionCallItem(OpenAIBase):
    """A function_call output item: a call the model made (call_id names it for the
    function_call_output sent back)."""
    id: str = Field(default_factory=lambda: f"fc_{secrets.token_hex(16)}")
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: f"call_{secrets.token_hex(12)}")
    name: str
    arguments: str = ""  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


def chat_tools(tools: list | None) -> list[ChatCompletionTool] | None:
    """The request's tools as chat's; a built-in tool or a malformed function is a 400 naming
    its place (tools[i].type, tools[i].name, ...)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIError(f"tools[{i}].type={kind!r} is refused: only function tools "
                              '({"type": "function", "name", "parameters"}) are served; '
                              "built-in tools (web_search, file_search, code_interpreter, "
                              "computer_use, image_generation, mcp, local_shell, custom) "
                              "are not", param=f"tools[{i}].type",
                              code="unsupported_parameter")
        try:
            f = FunctionTool.model_validate(tool)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise OpenAIError(f"tools[{i}].{where}: {err['msg']}", param=f"tools[{i}].{where}",
                              code="invalid_value") from None
        out.append(ChatCompletionTool(function=FunctionDefinition(
            name=f.name, description=f.description, parameters=f.parameters, strict=f.strict)))
    return out


def chat_tool_choice(choice):
    """tool_choice as chat's: "auto", "none", "required", or {"type": "function", "name"}
    (chat's named choice); OpenAI's allowed_tools and built-in tool choices are refused."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise OpenAIError(f"tool_choice={choice!r} must be \"auto\", \"none\", "
                              "\"required\" or {\"type\": \"function\", \"name\": ...}",
                              param="tool_choice", code="invalid_value")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
        raise OpenAIError(f"tool_choice of type {kind!r} is refused: only \"auto\", \"none\", "
                          "\"required\" and {\"type\": \"function\", \"name\": ...} are served",
                          param="tool_choice", code="unsupported_parameter")
    if not isinstance(choice.get("name"), str):
        raise OpenAIError("tool_choice {\"type\": \"function\"} needs the function's name "
                          "(a string)", param="tool_choice.name", code="invalid_value")
    return NamedToolChoice(function=NamedFunction(name=choice["name"]))


def _arguments(i: int, item) -> str:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(getattr(item, key), str):
            raise OpenAIError(f"input[{i}] (a function_call item) needs its {key!r} (a string)",
                              param=f"input[{i}].{key}", code="invalid_value")
    return item.arguments


def add_function_call(messages: list[ChatMessage], sources: list[str], i, item,
                      where: str) -> None:
    """A function_call item as a tool call of the assistant turn: the turn just before when it
    is the assistant's (its message, or the calls before it: parallel calls), else a new one."""
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": _arguments(i, item)}}
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        if last.tool_calls is None:
            last.tool_calls = []
        last.tool_calls.append(call)  # in place: thousands of parallel calls stay linear
        return
    messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
    sources.append(where)


def function_output_message(i: int, item, calls: set[str]) -> ChatMessage:
    """A function_call_output item as the tool message answering its call, one of `calls`
    (the call_ids of the function_call items before it, previous_response_id's too): an
    output answering no call is refused, as vLLM's ("No call message found")."""
    if not isinstance(item.call_id, str):
        raise OpenAIError(f"input[{i}] (a function_call_output item) needs the call_id of the "
                          "call it answers", param=f"input[{i}].call_id", code="invalid_value")
    if item.call_id not in calls:
        raise OpenAIError(f"input[{i}].call_id={item.call_id!r} answers no function call: no "
                          "function_call item with that call_id comes before it (in input, or "
                          "in the response previous_response_id continues); send the call "
                          "first, or continue the response that made it",
                          param=f"input[{i}].call_id", code="invalid_value")
    output = item.output
    if isinstance(output, list):  # input_text parts
        texts = [p.get("text") if isinstance(p, dict) else None for p in output]
        if any(not isinstance(t, str) for t in texts):
            raise OpenAIError(f"input[{i}].output must be a string or input_text parts",
                              param=f"input[{i}].output", code="invalid_value")
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise OpenAIError(f"input[{i}].output must be a string (the function's result)",
                          param=f"input[{i}].output", code="invalid_value")
    return ChatMessage(role="tool", content=output, tool_call_id=item.call_id)


def call_items(calls: list[ToolCall], own_ids: bool = False) -> list[FunctionCallItem]:
    """The calls read from a whole answer as output items; `own_ids`: their call_ids are the
    parser's (ToolParser.template_checks_ids)."""
    return [FunctionCallItem(name=c.function.name, arguments=c.function.arguments,
                             **({"call_id": c.id} if own_ids else {})) for c in calls]
