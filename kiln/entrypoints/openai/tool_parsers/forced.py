"""Tool calls under tool_choice "required" or a named function: structured outputs force the
answer's shape (forced_schema), and these parsers read it: a named call's answer is its
arguments; a required one's is a JSON array of {"name": ..., "parameters": {...}}."""
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    scan_calls,
    skip_ws,
    value_end,
)

_ANY_OBJECT = {"type": "object"}


_DEFS_KEYS = ("$defs", "definitions")


def required_schema(tools, max_calls: int | None = None) -> dict:
    """One or more calls (at most max_calls), each to one of `tools` with its parameters
    (vLLM's shape). ValueError where two tools define one $defs (or definitions) name
    differently."""
    defs: dict[str, dict] = {}
    options = []
    for tool in tools:
        params = tool.function.parameters or _ANY_OBJECT
        options.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": _hoist_defs(tool.function.name, params,
                                                                  defs)},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1,
              "items": options[0] if len(options) == 1 else {"anyOf": options}, **defs}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def _hoist_defs(name: str, params: dict, defs: dict[str, dict]) -> dict:
    """`params` without its $defs and definitions, which go to `defs`: nested under the
    combined schema's items, a "#/$defs/X" reference (pydantic's, the OpenAI SDK's) would
    point at its root."""
    hoisted = [key for key in _DEFS_KEYS if isinstance(params.get(key), dict)]
    for key in hoisted:
        for def_name, sub in params[key].items():
            seen = defs.setdefault(key, {}).setdefault(def_name, sub)
            if seen != sub:
                raise ValueError(f"function {name!r} defines {key} {def_name!r} otherwise than "
                                 "another tool does: under tool_choice \"required\" all "
                                 "tools' definitions share one namespace, so rename one")
    return {k: v for k, v in params.items() if k not in hoisted}


class NamedToolParser(ToolParser):
    forced = True

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        i = skip_ws(text, 0)
        if i == len(text):  # nothing past the thinking yet: a stream must not announce a call
            return "", []
        # The grammar ends with the arguments' JSON value; past it (ignore_eos) the model
        # writes on unconstrained, and none of that is the call. Cut short, the arguments are
        # all the text, trailing whitespace too: the stream sent it already.
        end = value_end(text, i, final, memo)
        return "", [PartialCall(name=self.name, args=text[i:end], done=end is not None)]


class RequiredToolParser(ToolParser):
    forced = True

    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return "", []
        return "", scan_calls(text, i + 1, ("parameters",), ",", final, memo)
