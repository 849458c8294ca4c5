"""Request bodies parsed by pydantic's JSON parser (jiter) instead of `json.loads`: FastAPI
parses every body on the event loop, where 4 MB of token ids took 33 ms against 20."""
import json
from collections.abc import Callable
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute

from kiln.engine.text_encoding import encoding_problem
from kiln.entrypoints.openai.errors import OpenAIBodyError, OpenAIError


def parse_json(body: bytes) -> Any:
    """json.loads(body)'s value. jiter refuses what json.loads may take (UTF-16 or a BOM, lone
    surrogate escapes, which JSONBodyRequest refuses by name) or what it names the error of:
    those fall back to json.loads, so the value or the JSONDecodeError is the same. What
    json.loads cannot read for another reason is a JSONDecodeError too, saying why."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return _parse_with_json_loads(body)


def _parse_with_json_loads(body: bytes) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise
    # FastAPI answers anything but a JSONDecodeError with a bare "error parsing the body".
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError(f"the body is not UTF-8 text ({e.reason} at byte {e.start}); "
                                   "send JSON encoded as UTF-8, uncompressed", "", 0) from None
    except RecursionError:
        raise json.JSONDecodeError("the body nests arrays or objects too deeply", "", 0) from None
    except ValueError as e:  # an integer past Python's digit limit
        raise json.JSONDecodeError(str(e), "", 0) from None


def lone_surrogate_error(value: Any) -> OpenAIError | None:
    """A 400 naming the first string (or key) of a parsed body that holds a lone UTF-16
    surrogate (JSON's "\\ud800"), or None. Such text reached every field: the model's name
    in a 404 and a named tool in the answer failed to render (500s, the second after the whole
    generation), a stop string or request_id failed on its way to the engine core (a 400 that
    named the prompt), a bad word inside the tokenizer (a 500)."""
    todo = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            problem = encoding_problem(v)
            if problem is not None:
                return OpenAIError(f"{path or 'the body'} {problem}", param=path or None,
                                   code="invalid_value")
        elif isinstance(v, dict):
            for key in v:
                problem = encoding_problem(key)
                if problem is not None:
                    return OpenAIError(f"{path or 'the body'} has a key that {problem}",
                                       param=path or None, code="invalid_value")
            todo.extend((f"{path}.{k}" if path else k, item) for k, item in reversed(v.items())
                        if isinstance(item, (str, list, dict)))
        elif isinstance(v, list):  # reversed: the first in the body is reported
            todo.extend((f"{path}[{i}]", v[i]) for i in range(len(v) - 1, -1, -1)
                        if isinstance(v[i], (str, list, dict)))
    return None


class JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError:
                # Only what jiter refused may hold a lone surrogate: a body of 600k token ids
                # is not walked on the event loop.
                try:
                    value = _parse_with_json_loads(body)
                except json.JSONDecodeError as e:
                    if not e.doc:  # one of ours, saying why
                        raise
                    # FastAPI shows the bare msg: "Invalid control character at", no place
                    raise json.JSONDecodeError(f"{e.msg} line {e.lineno} column {e.colno} "
                                               f"(char {e.pos})", e.doc, e.pos) from None
                if (error := lone_surrogate_error(value)) is not None:
                    raise OpenAIBodyError(error) from None
                self._json = value
        return self._json


class JSONBodyRoute(APIRoute):
    """A route whose body FastAPI reads through JSONBodyRequest."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))
        return route
