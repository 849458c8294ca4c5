"""What /openapi.json says POST /v1/responses takes, as the handler checks it
(responses_input.py, responses_tools.py): message items of the known roles with text parts,
function_call and function_call_output items, function tools and tool_choice, the refused fields
at their off values only, and the sampling fields' ranges.
"""
from kiln.entrypoints.openai.openapi_cross_field import switched_fields
from kiln.entrypoints.openai.protocol import REASONING_EFFORTS
from kiln.entrypoints.openai.responses_input import REFUSED, ROLES, TEXT_PARTS

_NULL = {"type": "null"}


def _part() -> dict:
    """A content part: a text kind with its text (a string)."""
    return {"anyOf": [{"type": "object", "required": ["type", key], "properties": {
        "type": {"enum": [kind for kind, k in TEXT_PARTS.items() if k == key]},
        key: {"type": "string"}}} for key in sorted(set(TEXT_PARTS.values()))]}


def _item() -> dict:
    """A message item (type "message", null or absent), its role one of ROLES, its content text."""
    return {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message", None]}, "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _part()}]},
        "id": {"anyOf": [{"type": "string"}, _NULL]},
        "status": {"anyOf": [{"type": "string"}, _NULL]}}}


def _reasoning_item() -> dict:
    """A reasoning item sent back as history: its text in reasoning_text content or summary
    parts, never encrypted."""
    texts = {"anyOf": [_NULL, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {
            "type": {"type": "string"}, "text": {"type": "string"}}}}]}
    return {"type": "object", "required": ["type"], "properties": {
        "type": {"const": "reasoning"}, "content": texts, "summary": texts,
        "encrypted_content": _NULL, "id": {"anyOf": [{"type": "string"}, _NULL]},
        "status": {"anyOf": [{"type": "string"}, _NULL]}}}


def _call_items() -> list[dict]:
    """function_call (call_id, name, arguments) and function_call_output (call_id, output)."""
    string = {"type": "string"}
    call = {"type": "object", "required": ["type", "call_id", "name", "arguments"],
            "properties": {"type": {"const": "function_call"}, "call_id": string,
                           "name": string, "arguments": string}}
    output = {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": string,
        "output": {"anyOf": [string, {"type": "array", "items": {
            "type": "object", "required": ["text"], "properties": {"text": string}}}]}}}
    return [call, output]


def _tools() -> dict:
    """Function tools only (built-in ones are refused)."""
    return {"anyOf": [_NULL, {"type": "array", "items": {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string"},
            "description": {"anyOf": [{"type": "string"}, _NULL]},
            "parameters": {"anyOf": [{"type": "object"}, _NULL]},
            "strict": {"anyOf": [{"type": "boolean"}, _NULL]}}}}], "title": "Tools"}


def _off(value) -> dict:
    """Only null or the field's off value."""
    if value is None:
        return _NULL
    if value == []:
        return {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]}
    return {"enum": [None, value]}


def responses_request(components: dict, max_model_len: int | None, store: bool) -> None:
    """Patch ResponsesRequest and what it holds in `components` (after the null defaults and
    sampling ranges are stated); `store`: whether the server keeps responses, which
    previous_response_id and background need (responses_store.py refuses them without)."""
    request = components.get("ResponsesRequest")
    if request is None:
        return
    props = request["properties"]
    title = props["input"].get("title")
    props["input"] = {"anyOf": [{"type": "string"},
                                {"type": "array", "minItems": 1,
                                 "items": {"anyOf": [_item(), _reasoning_item(),
                                                     *_call_items()]}}],
                      **({"title": title} if title else {})}
    for name, (off, _) in REFUSED.items():
        props[name] = {**_off(off), "title": props[name].get("title", name)}
    if not store:
        for name, off in (("previous_response_id", None), ("background", False)):
            props[name] = {**_off(off), "title": props[name].get("title", name)}
    props["tools"] = _tools()
    props["tool_choice"] = {"anyOf": [{"enum": [None, "auto", "none", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string"}}}],
        "title": "Tool Choice"}
    props["truncation"] = {"enum": [None, "disabled"], "title": "Truncation"}
    props["reasoning"] = {"anyOf": [_NULL, {
        "type": "object", "properties": {"effort": {"enum": [None, *REASONING_EFFORTS]}},
        "additionalProperties": _NULL}], "title": "Reasoning"}
    maximum = {} if max_model_len is None else {"maximum": max_model_len - 1}
    props["max_output_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1, **maximum},
                                            _NULL], "title": "Max Output Tokens"}
    switched_fields(request)  # stream_options needs stream=true
    config = components.get("TextConfig", {}).get("properties", {})
    if "verbosity" in config:
        config["verbosity"] = {"enum": [None, "medium"], "title": "Verbosity"}
    fmt = components.get("TextFormat")
    if fmt is not None:  # json_schema needs its schema
        fmt["anyOf"] = [{"properties": {"type": {"enum": ["text", "json_object", None]}}},
                        {"required": ["type", "schema"], "properties": {
                            "type": {"const": "json_schema"}, "schema": {"type": "object"}}}]
    for name in ("ResponseInputItem", "ResponseContentPart"):
        components.pop(name, None)  # stated inline above
