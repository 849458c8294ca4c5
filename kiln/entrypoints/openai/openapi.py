"""/openapi.json as the server behaves: errors are 400 OpenAI bodies (FastAPI's default schema
says 422), streams are server-sent events, lists the server refuses empty say minItems 1, and
token ids are bounded by the served model's vocabulary.

FastAPI builds the schema from the routes; `describe` patches what it cannot know, once.
"""
import collections
import warnings

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kiln.entrypoints.openai.openapi_cross_field import (
    CONTINUE_AND_NEW_TURN,
    EMPTY_TEXT_BARE,
    GENERATE_NOTHING,
    one_constraint,
    refuse,
    switched_fields,
)
from kiln.entrypoints.openai.openapi_responses import describe_bodies
from kiln.entrypoints.openai.openapi_responses_request import responses_request
from kiln.entrypoints.openai.openapi_sampling import (
    off_only,
    repetition_detection_object,
    sampling_ranges,
    structured_outputs_object,
)
from kiln.entrypoints.openai.protocol_base import RequestBase, RequestPart
from kiln.entrypoints.openai.response_models import ErrorResponse

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


def decimal_below(n: int) -> str:
    """A regex of the decimal strings (ASCII digits, leading zeros allowed, as the server reads
    logit_bias keys) whose value is in [0, n), n >= 1: what the schema can say of a token id
    written as a JSON object key."""
    top = str(n - 1)
    width = len(top)
    alternatives = ["0"]
    if width > 1:  # every shorter number
        alternatives.append("[1-9]" + (f"[0-9]{{0,{width - 2}}}" if width > 2 else ""))
    for i, digit in enumerate(top):  # as long as top: its first i digits, then a smaller one
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = width - i - 1
            alternatives.append(f"{top[:i]}[{low}-{high}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^0*(?:" + "|".join(alternatives) + ")$"


def _request_models() -> set[str]:
    names, todo = set(), [RequestBase, RequestPart]
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


def patch_schema(schema: dict, vocab_size: int | None = None,
                 empty_text_has_tokens: bool = True, reasoning_parser: bool = False,
                 max_model_len: int | None = None,
                 open_paths: tuple[str, ...] | None = None,
                 request_chat_template: bool = False, max_logprobs: int = 20,
                 responses_store: bool = False, max_sequences: int | None = None) -> dict:
    """`vocab_size`: the served model's, bounding the token-id fields (None: unbounded).
    `empty_text_has_tokens`: the tokenizer adds BOS, so "" is a prompt (else refused).
    `reasoning_parser`: the server splits reasoning off (include_reasoning may be false).
    `max_model_len`: the served context, bounding the tokens to generate.
    `open_paths`: with --api-key, the paths that take no key (None: no key anywhere).
    `request_chat_template`: --trust-request-chat-template (else chat_template is null only).
    `max_logprobs`: the engine's cap on (top_/prompt_)logprobs (--max-logprobs, resolved).
    `max_sequences`: --max-sequences-per-request, which bounds n beside KILN_MAX_N_SEQUENCES.
    `responses_store`: /v1/responses keeps responses (else previous_response_id and background
    are refused, so null / false only)."""
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
    describe_bodies(schema, _ERROR_REF)
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
    function = components.get("FunctionDefinition")
    if function is not None:  # a blank name is refused: no stream could announce the call
        function["properties"]["name"]["pattern"] = r"\S"
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
    if "ChatCompletionRequest" in components:
        refuse(components["ChatCompletionRequest"], CONTINUE_AND_NEW_TURN)
    if tokenize is not None:  # only a chat (messages) has a final message to continue
        refuse(tokenize, {"required": [*CONTINUE_AND_NEW_TURN["required"], "messages"],
                           "properties": {**CONTINUE_AND_NEW_TURN["properties"],
                                          "messages": {"not": {"type": "null"}}}})
    for model in ("ChatCompletionRequest", "TokenizeRequest"):
        template = components.get(model, {}).get("properties", {}).get("chat_template")
        if template is not None and not request_chat_template:
            components[model]["properties"]["chat_template"] = {
                "type": "null", **{k: template[k] for k in ("title", "default") if k in template}}
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        if model in components:
            off_only(components[model], reasoning_parser)
            switched_fields(components[model])
            sampling_ranges(components[model], max_logprobs, vocab_size, max_sequences)
            so = components[model]["properties"].get("structured_outputs", {})
            so["anyOf"] = [structured_outputs_object() if m.get("type") == "object" else m
                           for m in so.get("anyOf", ())]
            one_constraint(components[model])
            for name in ("guided_regex", "guided_grammar", "guided_json", "structural_tag"):
                for member in components[model]["properties"].get(name, {}).get("anyOf", ()):
                    if member.get("type") == "string":  # an empty pattern is refused
                        member["minLength"] = 1
    if "RepetitionDetection" in components:
        repetition_detection_object(components["RepetitionDetection"])
    if "CompletionRequest" in components:
        refuse(components["CompletionRequest"], EMPTY_TEXT_BARE)
        refuse(components["CompletionRequest"], GENERATE_NOTHING)
        if not empty_text_has_tokens:
            refuse(components["CompletionRequest"], {"required": ["prompt"], "properties": {
                "prompt": EMPTY_TEXT_BARE["properties"]["prompt"]}})
    if vocab_size is not None:
        for model, prop in _TOKEN_IDS:
            prop_schema = components.get(model, {}).get("properties", {}).get(prop)
            if prop_schema is not None:
                _integers_bounded(prop_schema, 0, vocab_size - 1)
        for model in ("CompletionRequest", "ChatCompletionRequest"):
            bias = components.get(model, {}).get("properties", {}).get("logit_bias", {})
            for member in bias.get("anyOf", ()):
                if "propertyNames" in member:  # its keys are token ids too
                    member["propertyNames"] = {"pattern": decimal_below(vocab_size)}
    _max_tokens_bounded(components, max_model_len)
    if "ResponsesRequest" in components:
        sampling_ranges(components["ResponsesRequest"], max_logprobs, vocab_size)
        responses_request(components, max_model_len, responses_store)
    if open_paths is not None:
        _key_required(schema, open_paths)
    return schema


def _key_required(schema: dict, open_paths: tuple[str, ...]) -> None:
    """Every route but `open_paths` takes `Authorization: Bearer <key>` (without it a 401, the
    default error response)."""
    schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"apiKey": []}]
    for path in open_paths:
        for operation in schema.get("paths", {}).get(path, {}).values():
            operation["security"] = []


def _max_tokens_bounded(components: dict, max_model_len: int | None) -> None:
    """More tokens to generate than max_model_len - 1 never fit beside a prompt (one token at
    least) and are refused (400 context_length_exceeded). Chat's max_tokens stays unbounded:
    max_completion_tokens, when given, overrides it unchecked; its description states the
    rule (a third switch outgrows schemathesis' canonicalizer: openapi_cross_field)."""
    for model, name in (("CompletionRequest", "max_tokens"),
                        ("ChatCompletionRequest", "max_completion_tokens")):
        prop = components.get(model, {}).get("properties", {}).get(name, {})
        for member in prop.get("anyOf", [prop]):
            if member.get("type") == "integer" and max_model_len is not None:
                member["maximum"] = max_model_len - 1
    prop = components.get("ChatCompletionRequest", {}).get("properties", {}).get("max_tokens")
    if prop is not None:
        most = "max_model_len - 1" if max_model_len is None else f"{max_model_len - 1} " \
            f"(max_model_len {max_model_len} - 1)"
        prop["description"] = (
            "Deprecated for max_completion_tokens, which overrides it: read only where "
            "max_completion_tokens is absent or null, then at least 1 and at most "
            f"{most}, and with the prompt within the context; else a 400 naming max_tokens. "
            "Null or absent too: up to the context's end (or the model's generation_config "
            "max_new_tokens, where it sets one).")


def unique_operation_ids(schema: dict) -> dict:
    """FastAPI gives every method of one route the route's operationId (/ping's GET and POST):
    a shared id is suffixed with each operation's method. One route, not one per method, so a
    405 lists every method the path takes in its Allow header."""
    ops = [op for path in schema.get("paths", {}).values() for op in path.values()]
    seen = collections.Counter(op.get("operationId") for op in ops)
    for path in schema.get("paths", {}).values():
        for method, op in path.items():
            if seen[op.get("operationId")] > 1:
                op["operationId"] = f"{op['operationId']}_{method}"
    return schema


def describe(app: FastAPI, **served) -> None:
    """Serve the patched schema at /openapi.json (built on first request); `served`: what
    patch_schema takes about the served model and flags."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # the duplicates it warns of are renamed below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                # servers: --root-path's prefix, which FastAPI's /openapi.json route adds
                schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                     servers=app.servers or None)
            app.openapi_schema = patch_schema(unique_operation_ids(schema), **served)
        return app.openapi_schema

    app.openapi = openapi
