"""The rules across a request's fields, as JSON Schema /openapi.json states them: each spelled
so schemathesis' canonicalizer models it beside the others (it gives up past a budget).
"""

# continue_final_message continues the last message; add_generation_prompt opens a new turn:
# both true is refused, an explicit true only (its default true yields, as in vLLM).
CONTINUE_AND_NEW_TURN = {"required": ["continue_final_message", "add_generation_prompt"],
                          "properties": {"continue_final_message": {"const": True},
                                         "add_generation_prompt": {"const": True}}}
# Empty text with add_special_tokens false is no tokens: refused.
EMPTY_TEXT_BARE = {"required": ["add_special_tokens", "prompt"], "properties": {
    "add_special_tokens": {"const": False},
    "prompt": {"anyOf": [{"const": ""}, {"type": "array", "contains": {"const": ""}}]}}}

# max_tokens 0 only scores an echoed prompt (sampling.echo_only): without echo, and with
# min_tokens above it, refused.
GENERATE_NOTHING = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}},
                    "anyOf": [{"properties": {"echo": {"not": {"const": True}}}},
                              {"required": ["min_tokens"],
                               "properties": {"min_tokens": {"exclusiveMinimum": 0}}}]}

_NULL_ONLY = {"type": "null"}
# switch -> (what turns it on; field -> what it takes with the switch off; field -> what it
# takes with it on): top_logprobs needs logprobs (sampling.py), stream_options needs stream
# (serving_engine.check_stream_options), prompt_logprobs are not streamed (vLLM's rule: 0,
# which asks for no top entries, is taken).
# parallel_tool_calls=false needing tools (tool_plan.py) as a third split, however spelled,
# outgrows the canonicalizer's intersections beside the other rules: not stated.
_SWITCHES = {
    "stream": ({"const": True}, {"stream_options": _NULL_ONLY},
               {"prompt_logprobs": {"enum": [None, 0]}}),
    "logprobs": ({"const": True}, {"top_logprobs": _NULL_ONLY}, {})}


def switched_fields(model_schema: dict) -> None:
    """Fields that need a switch on, or off: per switch, a oneOf of its two cases (on, and
    what the fields take then; anything else, and what they take then). Spelled so because
    schemathesis' canonicalizer outgrows the intersections it models when each rule is its
    own refused shape (allOf of nots), if/then, anyOf or dependentSchemas beside the others."""
    props = model_schema.get("properties", {})
    for switch, (turned_on, when_off, when_on) in _SWITCHES.items():
        when_off = {f: v for f, v in when_off.items() if f in props}
        when_on = {f: v for f, v in when_on.items() if f in props}
        if switch not in props or not (when_on or when_off):
            continue
        on = {"required": [switch], "properties": {switch: turned_on, **when_on}}
        off = {"properties": {switch: {"not": turned_on}, **when_off}}
        model_schema.setdefault("allOf", []).append({"oneOf": [on, off]})


# A field that leaves the output free: null (or absent); response_format also as text (its
# type "text", or none).
NULL = {"const": None}
_FREE = {"response_format": {"anyOf": [NULL, {"type": "object", "properties": {
    "type": {"enum": ["text", None]}}}]}}


def one_constraint(model_schema: dict) -> None:
    """At most one of the fields that constrain the output (the handler refuses two with a 400
    naming both): every one free, or exactly one of "all free but this one" cases holding (a
    oneOf: with one field set only its case holds; with none set all do, which the first
    branch admits). Spelled so because schemathesis' canonicalizer expands a refused shape
    per pair, or disjoint cases, beside the other refusals past what it resolves, and keeps
    this oneOf whole."""
    from kiln.entrypoints.openai.structured_fields import CONSTRAINT_FIELDS

    present = [f for f in CONSTRAINT_FIELDS if f in model_schema.get("properties", {})]
    if len(present) < 2:
        return

    def free(kept: str | None = None) -> dict:
        return {"properties": {f: _FREE.get(f, NULL) for f in present if f != kept}}
    model_schema.setdefault("allOf", []).append(
        {"anyOf": [free(), {"oneOf": [free(kept) for kept in present]}]})


def refuse(model_schema: dict, shape: dict) -> None:
    """`model_schema` no longer matches bodies of `shape` (several shapes: allOf of nots)."""
    model_schema.setdefault("allOf", []).append({"not": shape})
