"""`qwen3_coder`: Qwen3-Coder tool calls in XML,
`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`; content is
the text before the first `<tool_call>` (or `<function=`). A parameter's value is text, turned
into JSON by the type the request's tool gives it (vLLM's conversions: integer, number,
boolean, object / array by json, other types by Python's literal syntax read with
`ast.literal_eval`, never evaluated; "null" or "None" is null unless the type is a string one
that admits no null; a value that does not convert stays a string). As vLLM's, a missing
</parameter> or </tool_call> is forgiven, and a </parameter> or </function> inside a value
(not followed by the next tag) is text; a function with no ">" after its name, or a value
that is no JSON, makes the whole answer content."""
import ast
import json
import re

from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    partial_suffix,
    skip_ws,
)

TOOL_CALL = "<tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
TOOL_CALL_END = "</tool_call>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_NOT_A_NAME = re.compile(r"[\s<]")
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_INTEGERS = ("int", "uint", "long", "short", "unsigned")
# A stream's state in its ScanMemo (whose own keys, value indices, are >= 0): the calls read
# whole, and where the search for each open one's </function> goes on, by where they start.
_CALLS_KEY, _RESUME_KEY = -1, -2


def _properties(tools, name: str) -> dict:
    """The named tool's parameter schemas; `tools` the request's, or OpenAI tool dicts (an
    offline LLM.chat caller's)."""
    for tool in tools:
        function = tool.get("function") or {} if isinstance(tool, dict) else tool.function
        if isinstance(function, dict):
            found, params = function.get("name"), function.get("parameters")
        else:
            found, params = function.name, function.parameters
        if found == name:
            if isinstance(params, dict):
                return params.get("properties", params)
            return {}
    return {}


def _type(schema) -> tuple[str, bool]:
    """(the schema's type, as vLLM reads it; whether it admits null): "type", else the first
    non-null type of an anyOf, else string."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    kinds = [str(o["type"]).strip().lower() for o in schema.get("anyOf") or ()
             if isinstance(o, dict) and "type" in o]
    return next((k for k in kinds if k != "null"), "string"), "null" in kinds


def _literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def convert(value: str, schema) -> object:
    """A parameter's text as the JSON value its schema's type asks for (vLLM's rules)."""
    kind, nullable = _type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in _STRINGS:
        return value  # "null" too: a string that says null
    if value.lower() in ("null", "none"):
        return None
    if kind.startswith(_INTEGERS):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return number if number - int(number) != 0 else int(number)
        except (ValueError, OverflowError):  # not a number; nan, inf
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            pass
        else:  # a JSON string of a Python repr ("{'k': 'v'}"): read once more
            return _literal(parsed) if isinstance(parsed, str) else parsed
    parsed = _literal(value)
    return _literal(parsed) if container and isinstance(parsed, str) else parsed


def _closes(text: str, i: int, nexts: tuple[str, ...], final: bool) -> bool | None:
    """Whether an end tag that ends at text[i] is the structure's (only whitespace, then one of
    `nexts` or the end of a final text, follows: a value may hold the tag as text, as vLLM
    reads it); None while the text so far cannot tell."""
    j = skip_ws(text, i)
    rest = text[j:j + max(map(len, nexts))]
    if any(rest.startswith(n) for n in nexts):
        return True
    if not rest:
        return True if final else None
    return None if not final and any(n.startswith(rest) for n in nexts) else False


def _value_end(body: str, i: int) -> tuple[int, int]:
    """(where the parameter value from body[i] ends, where the next parameter starts or -1):
    at a </parameter> that closes it, else where the next parameter starts (a missing
    </parameter> forgiven)."""
    following = body.find(PARAMETER, i)
    close = body.find(PARAMETER_END, i)
    while close >= 0 and (following < 0 or close < following):
        after = close + len(PARAMETER_END)
        if _closes(body, after, (PARAMETER,), True):
            return close, body.find(PARAMETER, after)
        close = body.find(PARAMETER_END, after)
    return (len(body) if following < 0 else following), following


def _function_end(text: str, start: int, final: bool, resume: dict) -> int | None:
    """Where the function whose name starts at text[start] ends (its </function>, or the end
    of a final text); None while it may still be open. A final text with no </function> that
    the next tag follows ends at its first. `resume[start]`: where a stream's search goes on
    (a </function> found to be text stays text as the text grows)."""
    at = text.find(FUNCTION_END, resume.get(start, start))
    while at >= 0:
        closes = _closes(text, at + len(FUNCTION_END), (TOOL_CALL_END, TOOL_CALL, FUNCTION),
                         final)
        if closes is None:
            return None
        if closes:
            return at
        resume[start] = at = at + len(FUNCTION_END)
        at = text.find(FUNCTION_END, at)
    if not final:
        return None
    first = text.find(FUNCTION_END, start)
    return len(text) if first < 0 else first


def _call(body: str, tools) -> PartialCall:
    """A whole `<function=...` (its text after "=", before </function>) as a call."""
    gt = body.find(">")
    if gt < 0:
        return not_a_call()
    name = body[:gt]
    if not name or _NOT_A_NAME.search(name):  # e.g. "f\n<parameter=a": its ">" never came
        return not_a_call()
    properties = _properties(tools, name)
    args = {}
    at = body.find(PARAMETER, gt + 1)
    while at >= 0:
        end = body.find(">", at + len(PARAMETER))
        if end < 0 or _NOT_A_NAME.search(body, at + len(PARAMETER), end):
            return not_a_call()  # e.g. "<parameter=a\n1</parameter>": its ">" never came
        key, value_end, at = body[at + len(PARAMETER):end], *_value_end(body, end + 1)
        value = body[end + 1:value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = convert(value, properties[key]) if key in properties else value
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a literal JSON has no form for (a set, bytes, inf)
        return not_a_call()
    return PartialCall(name=name, args=text, done=True)


class Qwen3CoderToolParser(ToolParser):
    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        starts = [i for i in (text.find(TOOL_CALL), text.find(FUNCTION)) if i >= 0]
        if not starts:
            held = 0 if final else max(partial_suffix(text, TOOL_CALL),
                                       partial_suffix(text, FUNCTION))
            return text[:len(text) - held], []
        first = min(starts)
        # Calls read whole, by where their name starts: a stream reads each once.
        read = memo.setdefault(_CALLS_KEY, {}) if memo is not None else {}  # type: ignore
        resume = memo.setdefault(_RESUME_KEY, {}) if memo is not None else {}  # type: ignore
        calls: list[PartialCall] = []
        at = text.find(FUNCTION, first)
        while at >= 0:
            start = at + len(FUNCTION)
            if start not in read:
                end = _function_end(text, start, final, resume)
                if end is None:
                    calls.append(PartialCall())  # open: whole once </function> comes
                    break
                read[start] = (_call(text[start:end], self.tools), end + len(FUNCTION_END))
            call, after = read[start]
            calls.append(call)
            if call.name is None:
                break
            at = text.find(FUNCTION, after)
        if not calls:  # <tool_call> with no function in it (yet)
            calls.append(not_a_call() if final else PartialCall())
        return text[:first], calls
