"""/openapi.json as the server behaves: errors are 400 OpenAI bodies (FastAPI's default schema
says 422), streams are server-sent events, lists the server refuses empty say minItems 1, and
token ids are bounded by the served model's vocabulary.

FastAPI builds the schema from the routes; `describe` patches what it cannot know, once.
"""
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kiln.entrypoints.openai.protocol import ErrorResponse, RequestBase

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# (schema, property): a JSON array there must not be empty (the handler refuses it with a 400).
_NON_EMPTY = [("ChatCompletionRequest", "messages"), ("CompletionRequest", "prompt"),
              ("TokenizeRequest", "messages"), ("CompletionRequest", "allowed_token_ids"),
              ("ChatCompletionRequest", "allowed_token_ids"),
              ("CompletionRequest", "guided_choice"), ("ChatCompletionRequest", "guided_choice")]
# (schema, property): integers there are token ids, refused outside [0, vocab_size).
_TOKEN_IDS = [("CompletionRequest", "prompt"), ("DetokenizeRequest", "tokens")] + [
    (model, prop) for model in ("CompletionRequest", "ChatCompletionRequest")
    for prop in ("allowed_token_ids", "stop_token_ids")]

_STREAMING = ("/v1/completions", "/v1/chat/completions")


def _error_response(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _arrays_non_empty(schema: dict) -> None:
    """Every array in `schema`, nested ones too (a batch of token-id lists), gets minItems 1."""
    if schema.get("type") == "array":
        schema["minItems"] = max(1, schema.get("minItems", 0))
        if isinstance(schema.get("items"), dict):
            _arrays_non_empty(schema["items"])
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key, ()):
            _arrays_non_empty(member)


def _integers_bounded(schema: dict, low: int, high: int) -> None:
    """Every integer in `schema` (array items, nested ones, union members) gets [low, high]."""
    if schema.get("type") == "integer":
        schema["minimum"], schema["maximum"] = low, high
    if isinstance(schema.get("items"), dict):
        _integers_bounded(schema["items"], low, high)
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key, ()):
            _integers_bounded(member, low, high)


def _request_models() -> set[str]:
    names, todo = set(), [RequestBase]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def _nulls_allowed(model_schema: dict) -> None:
    """An optional request field takes null as its default (OpenAIBase._null_is_default)."""
    required = set(model_schema.get("required", ()))
    for name, prop in model_schema.get("properties", {}).items():
        if name in required or prop.get("type") == "null" or any(
                m.get("type") == "null" for m in prop.get("anyOf", ())):
            continue
        keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        model_schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **keep}


# continue_final_message continues the last message; add_generation_prompt (default true)
# opens a new turn: true with anything but an explicit false is refused.
_CONTINUE_AND_NEW_TURN = {"required": ["continue_final_message"], "properties": {
    "continue_final_message": {"const": True}, "add_generation_prompt": {"not": {"const": False}}}}
# Empty text with add_special_tokens false is no tokens: refused.
_EMPTY_TEXT_BARE = {"required": ["add_special_tokens", "prompt"], "properties": {
    "add_special_tokens": {"const": False},
    "prompt": {"anyOf": [{"const": ""}, {"type": "array", "contains": {"const": ""}}]}}}


def _off_only(model_schema: dict, reasoning_parser: bool) -> None:
    """Fields that ask for what Kiln does not do (sampling.OFF_ONLY; reasoning_effort) take
    only their off value or null; include_reasoning=false needs a reasoning parser."""
    from kiln.entrypoints.openai.sampling import OFF_ONLY

    props = model_schema.get("properties", {})
    offs = {name: off for name, (off, _) in OFF_ONLY.items()}
    offs["reasoning_effort"] = None
    if not reasoning_parser:
        offs["include_reasoning"] = True
    empties = {"string": {"const": ""}, "object": {"type": "object", "maxProperties": 0},
               "array": {"type": "array", "maxItems": 0}}
    for name, off in offs.items():
        if name in props:
            types = {m.get("type") for m in props[name].get("anyOf", [props[name]])}
            if None in types:  # any JSON value: each empty one is off
                types = set(empties)
            allowed = [{"type": "null"}] + [empties[t] for t in sorted(types & set(empties))] \
                if off is None else [{"const": off}, {"type": "null"}]
            keep = {k: props[name][k] for k in ("title", "default") if k in props[name]}
            props[name] = {"anyOf": allowed, **keep}
    # prompt_logprobs are not streamed (vLLM's rule)
    if "prompt_logprobs" in props:
        _refuse(model_schema, {"required": ["prompt_logprobs", "stream"], "properties": {
            "prompt_logprobs": {"not": {"type": "null"}}, "stream": {"const": True}}})


def _refuse(model_schema: dict, shape: dict) -> None:
    """`model_schema` no longer matches bodies of `shape` (several shapes: allOf of nots)."""
    model_schema.setdefault("allOf", []).append({"not": shape})


def patch_schema(schema: dict, vocab_size: int | None = None,
                 empty_text_has_tokens: bool = True, reasoning_parser: bool = False) -> dict:
    """`vocab_size`: the served model's, bounding the token-id fields (None: unbounded).
    `empty_text_has_tokens`: the tokenizer adds BOS, so "" is a prompt (else refused).
    `reasoning_parser`: the server splits reasoning off (include_reasoning may be false)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}")
    components.update(components["ErrorResponse"].pop("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = _error_response("Invalid request: the error names the field")
            if operation.get("operationId", "").startswith("health"):
                continue  # its 503 has no body
            # 401 (key), 404 (model), 413 (body size), 503 (engine gone): one error shape.
            responses.setdefault("default", _error_response("An error"))
    for path in _STREAMING:
        ok = schema.get("paths", {}).get(path, {}).get("post", {}).get("responses", {}).get("200")
        if ok is not None:  # stream=true answers with server-sent events
            ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    for model, prop in _NON_EMPTY:
        prop_schema = components.get(model, {}).get("properties", {}).get(prop)
        if prop_schema is not None:
            _arrays_non_empty(prop_schema)
    for name in _request_models() & set(components):
        _nulls_allowed(components[name])
    part = components.get("TextContentPart")
    if part is not None:  # any other part (or one without its text) is refused, naming it
        part["properties"]["type"]["enum"] = ["text"]
        part["properties"]["text"] = {"type": "string", "title": "Text"}
        part["required"] = ["type", "text"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        choice = components.get(model, {}).get("properties", {}).get("guided_choice")
        for member in (choice or {}).get("anyOf", ()):
            if member.get("type") == "array":  # choices are non-empty strings
                member["items"] = {"type": "string", "minLength": 1}
    tokenize = components.get("TokenizeRequest")
    if tokenize is not None:  # exactly one of prompt and messages (null is as absent)
        tokenize["anyOf"] = [
            {"required": [given], "properties": {given: {"not": {"type": "null"}},
                                                 other: {"type": "null"}}}
            for given, other in (("prompt", "messages"), ("messages", "prompt"))]
    for model in ("TokenizeRequest", "ChatCompletionRequest"):
        if model in components:
            _refuse(components[model], _CONTINUE_AND_NEW_TURN)
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        if model in components:
            _off_only(components[model], reasoning_parser)
            for name in ("guided_regex", "guided_grammar", "guided_json"):
                for member in components[model]["properties"].get(name, {}).get("anyOf", ()):
                    if member.get("type") == "string":  # an empty pattern is refused
                        member["minLength"] = 1
    if "CompletionRequest" in components:
        _refuse(components["CompletionRequest"], _EMPTY_TEXT_BARE)
        if not empty_text_has_tokens:
            _refuse(components["CompletionRequest"], {"required": ["prompt"], "properties": {
                "prompt": _EMPTY_TEXT_BARE["properties"]["prompt"]}})
    if vocab_size is not None:
        for model, prop in _TOKEN_IDS:
            prop_schema = components.get(model, {}).get("properties", {}).get(prop)
            if prop_schema is not None:
                _integers_bounded(prop_schema, 0, vocab_size - 1)
    return schema


def describe(app: FastAPI, **served) -> None:
    """Serve the patched schema at /openapi.json (built on first request); `served`: what
    patch_schema takes about the served model and flags."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = patch_schema(get_openapi(
                title=app.title, version=app.version, routes=app.routes), **served)
        return app.openapi_schema

    app.openapi = openapi
