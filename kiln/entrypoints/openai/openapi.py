"""/openapi.json as the server behaves: errors are 400 OpenAI bodies (FastAPI's default schema
says 422), streams are server-sent events, and lists the server refuses empty say minItems 1.

FastAPI builds the schema from the routes; `describe` patches what it cannot know, once.
"""
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kiln.entrypoints.openai.protocol import ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# (schema, property): a JSON array there must not be empty (the handler refuses it with a 400).
_NON_EMPTY = [("ChatCompletionRequest", "messages"), ("CompletionRequest", "prompt"),
              ("TokenizeRequest", "messages")]

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


def patch_schema(schema: dict) -> dict:
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
    return schema


def describe(app: FastAPI) -> None:
    """Serve the patched schema at /openapi.json (built on first request)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = patch_schema(get_openapi(
                title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
