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


# Keys whose values are data, not subschemas: a "$ref" in them is no reference.
_DATA_KEYS = ("enum", "const", "default", "examples")


def required_schema(tools, max_calls: int | None = None) -> dict:
    """One or more calls (at most max_calls), each to one of `tools` with its parameters
    (vLLM's shape). Each tool's parameters sit under the combined schema's $defs, their local
    references rebased there: nested under items as they were written, "#" (a recursive
    schema) and "#/$defs/X" (pydantic's, the OpenAI SDK's) would point at the combined root."""
    defs, options = {}, []
    for i, tool in enumerate(tools):
        where = f"#/$defs/kiln_tool_{i}"
        defs[f"kiln_tool_{i}"] = rebase_refs(tool.function.parameters or _ANY_OBJECT, where)
        options.append({"type": "object",
                        "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                       "parameters": {"$ref": where}},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1,
              "items": options[0] if len(options) == 1 else {"anyOf": options}, "$defs": defs}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def rebase_refs(schema, base: str):
    """A copy of `schema` whose local references ("#", "#/...") point under `base`."""
    if isinstance(schema, list):
        return [rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, base)
    return out


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
