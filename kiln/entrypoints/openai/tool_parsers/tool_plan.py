"""`plan_tools`: what a chat request's tools and tool_choice mean: the tools the template sees,
the constraint that forces a call (required, named) and the parser that reads the answer.

Pure: the server's flags come in as arguments; errors are 400s naming the field.
"""
import json
from dataclasses import dataclass

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.structured_fields import build_params
from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.schema_union import resolve


@dataclass
class ToolPlan:
    template_tools: list[dict] | None = None  # OpenAI tool dicts for the chat template
    parser: ToolParser | None = None  # None: the answer is all content
    constraint: StructuredOutputsParams | None = None  # forces the call's shape
    # finish_reason "tool_calls" when calls were made (auto, required; a named call keeps
    # "stop", as OpenAI and vLLM report it)
    calls_finish: bool = False
    # parallel_tool_calls=false: at most one call; /v1/responses' max_tool_calls: at most that
    # many (required: the grammar allows no more; auto: the first are kept, later ignored)
    max_calls: int | None = None


def template_tool_dicts(tools) -> list[dict] | None:
    """The request's tools as the chat template reads them (OpenAI tool dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def plan_tools(req, tool_call_parser: str | None, enable_auto_tool_choice: bool,
               max_tool_calls: int | None = None) -> ToolPlan:
    """`max_tool_calls`: /v1/responses' limit on the calls one answer makes (OpenAI's: calls
    past it are ignored); None: no limit."""
    plan = _plan(req, tool_call_parser, enable_auto_tool_choice, max_tool_calls)
    if plan.parser is not None:
        plan.parser.max_calls = plan.max_calls
    return plan


def call_limit(parallel_tool_calls: bool, max_tool_calls: int | None) -> int | None:
    """The most calls one answer may make: one without parallel calls, at most
    max_tool_calls (which must allow one: no calls at all is tool_choice "none")."""
    if max_tool_calls is not None and max_tool_calls < 1:
        raise OpenAIError(f"max_tool_calls must be at least 1, got {max_tool_calls}; for no "
                          'calls give tool_choice "none"', param="max_tool_calls",
                          code="invalid_value")
    limits = [n for n in (None if parallel_tool_calls else 1, max_tool_calls) if n is not None]
    return min(limits) if limits else None


def _plan(req, tool_call_parser: str | None, enable_auto_tool_choice: bool,
          max_tool_calls: int | None) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise OpenAIError(f"tool_choice {_shown(choice)} needs tools: give tools or drop "
                              "tool_choice", param="tool_choice", code="invalid_value")
        if not req.parallel_tool_calls:
            raise OpenAIError("parallel_tool_calls=false needs tools: give tools or drop it",
                              param="parallel_tool_calls", code="invalid_value")
        return ToolPlan()
    check_tools(tools)
    limit = call_limit(req.parallel_tool_calls, max_tool_calls)
    names = [t.function.name for t in tools]
    template_tools = template_tool_dicts(tools)
    if choice == "none":
        return ToolPlan(template_tools=template_tools)
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise OpenAIError('"auto" tool choice needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser; or pass "
                              'tool_choice "required", "none" or a named function',
                              param="tool_choice", code="invalid_value")
        parser = TOOL_PARSERS[tool_call_parser]()
        parser.tools = tuple(tools)
        return ToolPlan(template_tools=template_tools, parser=parser,
                        calls_finish=True, max_calls=limit)
    if choice == "required":
        try:
            schema = required_schema(tools, limit)
        except ValueError as e:
            raise OpenAIError(f"tools: {e}", param="tools", code="invalid_value") from None
        return ToolPlan(template_tools=template_tools, parser=RequiredToolParser(),
                        constraint=_forced(schema), calls_finish=True)
    name = choice.function.name
    if name not in names:
        raise OpenAIError(f"tool_choice names function {name!r}, which is not among tools "
                          f"{names}", param="tool_choice", code="invalid_value")
    tool = tools[names.index(name)]
    schema = tool.function.parameters or {"type": "object"}
    return ToolPlan(template_tools=template_tools, parser=NamedToolParser(name),
                    constraint=_forced(schema))


def check_tools(tools) -> None:
    """Refuse what OpenAI refuses in a tool, and what would come back broken: a call to a
    nameless function (no stream can announce it), arguments that are no JSON object."""
    for k, tool in enumerate(tools):
        name, params = tool.function.name, tool.function.parameters
        if not name.strip():
            raise OpenAIError(f"tools[{k}].function.name is empty: give each function a name",
                              param="tools", code="invalid_value")
        if params and not describes_objects(params, params):
            raise OpenAIError(f"tools[{k}] (function {name!r}): parameters must be a JSON "
                              f'schema of type "object" (arguments are a JSON object), got '
                              f"{_shorten(params)}", param="tools", code="invalid_value")


def describes_objects(schema, root, hops: int = 8) -> bool:
    """Whether every value `schema` allows is a JSON object: "type" object (or "properties"
    without a type, JSON Schema's way to describe members), a local $ref to such a schema
    (pydantic's root model), or an anyOf/oneOf whose every branch is one."""
    if not isinstance(schema, dict) or hops == 0:
        return False
    kind = schema.get("type")
    if kind is not None:
        return kind == "object" or kind == ["object"]
    if "properties" in schema:
        return True
    if isinstance(schema.get("$ref"), str):
        target = resolve(schema, root, hops=1)
        return target is not schema and describes_objects(target, root, hops - 1)
    branches = schema.get("anyOf", schema.get("oneOf"))
    return isinstance(branches, list) and bool(branches) and all(
        describes_objects(b, root, hops - 1) for b in branches)


def _shorten(value, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _forced(schema: dict) -> StructuredOutputsParams:
    """Forced calls are compact JSON: free whitespace only lets a weak model ramble on before
    the arguments close (the call parses the same either way). What the params refuse (a
    schema nested too deep) is a 400 naming tools, as response_format's is (it was a 500)."""
    return build_params(dict(json=schema, disable_any_whitespace=True), "tools")


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
