"""What /openapi.json says a 200 carries: each JSON body's model, and each server-sent event of
a stream (a chunk's JSON, an in-band error, then `[DONE]`), as FastAPI describes its own SSE.
"""
from pydantic import BaseModel

from kiln.entrypoints.openai.pooling_responses import (
    ClassificationResponse,
    RerankResponse,
    ScoreResponse,
)
from kiln.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
)
from kiln.entrypoints.openai.responses_objects import ResponsesResponse, ResponseStreamEvent
from kiln.entrypoints.openai.serving_engine import SSE_DONE

_REF = "#/components/schemas/{model}"
# path -> the 200's JSON body, and a stream chunk's (stream=true) where the route streams.
_BODIES: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": (CompletionResponse, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionStreamResponse),
    "/v1/responses": (ResponsesResponse, ResponseStreamEvent),
    "/v1/models": (ModelList, None), "/tokenize": (TokenizeResponse, None),
    "/detokenize": (DetokenizeResponse, None), "/classify": (ClassificationResponse, None),
    **{path: (ScoreResponse, None) for path in ("/score", "/v1/score")},
    **{path: (RerankResponse, None) for path in ("/rerank", "/v1/rerank", "/v2/rerank")}}
_VERSION = {"type": "object", "required": ["version"],
            "properties": {"version": {"type": "string", "title": "Version"}}}
DONE = SSE_DONE.removeprefix("data: ").strip()


def model_ref(components: dict, model: type[BaseModel]) -> dict:
    """`model` (as the server writes it: serialization mode) and the models it holds added to
    `components`; a $ref to it."""
    schema = model.model_json_schema(mode="serialization", ref_template=_REF)
    for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        # a request model of the same name would be overwritten: none may have one
        assert components.setdefault(name, sub) == sub, f"two schemas named {name}"
    return {"$ref": _REF.format(model=model.__name__)}


def event_schema(chunk: dict, error: dict) -> dict:
    """One server-sent event of a stream: its data a `chunk` or an `error` (what went wrong
    once the status line was sent) as JSON, or the closing [DONE]. OpenAPI 3.2's itemSchema
    (FastAPI writes it for its own streams): a stream is a sequence of these."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"anyOf": [{"const": DONE}, json_data]}, "event": {"const": "message"}}}


def describe_bodies(schema: dict, error: dict) -> None:
    """Each route's 200 states its body (FastAPI says `{}`: the handlers return responses it
    does not see), and each stream its events. `error`: the ErrorResponse $ref."""
    components = schema["components"]["schemas"]
    paths = schema.get("paths", {})
    for path, (body, chunk) in _BODIES.items():
        ok = next(iter(paths.get(path, {}).values()), {}).get("responses", {}).get("200")
        if ok is None:
            continue
        content = ok.setdefault("content", {})
        content["application/json"] = {"schema": model_ref(components, body)}
        if chunk is not None:  # stream=true
            item = event_schema(model_ref(components, chunk), error)
            if path == "/v1/responses":  # named events (the data's type; an error's is
                # "error"), no [DONE]
                item["properties"]["event"] = {"type": "string"}
                data = item["properties"]["data"] = item["properties"]["data"]["anyOf"][1]
                data["contentSchema"] = data["contentSchema"]["anyOf"][0]
            content["text/event-stream"] = {"itemSchema": item}
    version = paths.get("/version", {}).get("get", {}).get("responses", {}).get("200")
    if version is not None:
        version.setdefault("content", {})["application/json"] = {"schema": _VERSION}
