"""OpenAI-style errors: one exception type, its JSON body, and FastAPI handlers that emit it.

Validation failures become HTTP 400 (not FastAPI's 422) and name the offending field in `param`.
"""
import json
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.engine.async_llm_lifecycle import EngineDeadError
from kiln.entrypoints.openai.response_models import ErrorInfo, ErrorResponse
from kiln.logger import init_logger

logger = init_logger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable"}


class OpenAIError(Exception):
    """An error a handler returns to the client as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class OpenAIBodyError(StarletteHTTPException):
    """An OpenAIError found while FastAPI reads a request's body, where only an HTTPException
    passes through as itself (anything else is a bare "There was an error parsing the body")."""

    def __init__(self, error: OpenAIError):
        super().__init__(error.status, error.message)
        self.error = error


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
    return OpenAIError(message, status=status, param=param, code=code).body()


def request_value(value, limit: int = 80) -> str:
    """A request field's value as the client wrote it, in JSON (true, {"type": ...}): not
    Python's repr of what read it (True, NamedToolChoice(type='function', ...)); cut to
    `limit` characters."""
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_unset=True)
    text = json.dumps(to_jsonable_python(value, fallback=repr), ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def param_from_message(message: str, fields: dict[str, str]) -> str | None:
    """The request field a ValueError names: its first word, mapped through `fields`.

    `fields` maps engine names (SamplingParams fields, "prompt") to the API field to report.
    """
    first = message.split(" ", 1)[0].strip(":,")
    if first in fields:
        return fields[first]
    for name, api_name in fields.items():
        if message.startswith(name + " ") or f" {name} " in f" {message} ":
            return api_name
    return None


def in_api_terms(message: str, fields: dict[str, str],
                 renamed: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(message, param) of an engine ValueError: the field it names mapped through `fields`,
    the message opening with the name the client sent where it opens with the engine's, and
    each of `renamed`'s engine names (max_tokens -> max_completion_tokens, logprobs ->
    top_logprobs) the client's wherever the message says it ("min_tokens must be <= max_tokens",
    "lower max_tokens"); never inside a flag (--max-logprobs) or a longer name."""
    param = param_from_message(message, fields)
    first = message.split(" ", 1)[0]
    if fields.get(first, first) != first:
        message = fields[first] + message[len(first):]
    for engine, api in (renamed or {}).items():
        if api != engine:
            message = re.sub(rf"(?<![\w-]){re.escape(engine)}(?![\w-])", api, message)
    return message, param


def _loc_to_param(loc: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content" (a query parameter's:
    ("query", "stream") -> "stream"); None for the whole body."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query") else loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            if not out:  # a position in malformed JSON, not a field
                return None
            out += f"[{p}]"
        elif "[" in p or p in ("str", "int", "float", "bool", "list", "dict", "none"):
            break  # a union member tag pydantic appends; stop at the real field
        else:
            out += f".{p}" if out else p
    return out or None


# A field vLLM takes in place of a required one (prompt_embeds without a prompt, as vLLM's
# completions accept it) -> the field it stands in for.
_STAND_INS = {"prompt_embeds": "prompt"}


def _refused_stand_in(kind: str, param: str | None, body) -> OpenAIError | None:
    """The refusal of the field a client sent in place of a missing one, which says what to
    do: "missing required field 'prompt'" did not, to a client that sent prompt_embeds."""
    if kind != "missing" or not isinstance(body, dict):
        return None
    from kiln.entrypoints.openai.sampling import OFF_ONLY  # it imports this module

    for name, replaces in _STAND_INS.items():
        if replaces == param and body.get(name) is not None:
            return OpenAIError(f"{name} is refused: {OFF_ONLY[name][1]}; give {replaces}",
                               param=name, code="unsupported_parameter")
    return None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request", param=None, code="invalid_request")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return OpenAIError(f"request body is not valid JSON: {detail}", code="json_invalid")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if param is None and isinstance(first.get("input"), bytes):
        # FastAPI leaves a body unparsed unless its Content-Type is JSON (curl -d sends a form)
        return OpenAIError("the request body was not read as JSON: send it with the header "
                           "'Content-Type: application/json'", code="invalid_content_type")
    msg = first.get("msg", "invalid value")
    refused = _refused_stand_in(kind, param, first.get("input"))
    if refused is not None:
        return refused
    if kind == "missing":
        text = f"missing required field {param!r}" if param else "missing request body"
    elif param is None:
        text = f"request body: {msg} (expected a JSON object)"
    else:
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        text = f"{param}: {msg} (got {shown})"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return OpenAIError(text, param=param, code=kind or "invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        if isinstance(exc, OpenAIBodyError):
            return exc.error.response()
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        err = OpenAIError(message, status=exc.status_code,
                          code=phrase.lower().replace(" ", "_"))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_gone(_: Request, exc: EngineDeadError):
        # any route's engine call (/sleep, /collective_rpc, /metrics' stats ...) as a
        # generation request's: a 503, engine_dead or server_shutting_down; it was a 500
        from kiln.entrypoints.openai.serving_engine import engine_unavailable

        return engine_unavailable(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error while serving a request")
        return OpenAIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                           code="internal_error").response()
