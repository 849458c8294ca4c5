"""The Responses API's store, as vLLM keeps it with VLLM_ENABLE_RESPONSES_API_STORE=1 (Kiln:
KILN_ENABLE_RESPONSES_API_STORE, or vLLM's name): responses made with `store` (true by default)
are kept in this process's memory, the newest MAX_STORED of them (vLLM's store is unbounded; a
background response still running is never the one forgotten); GET /v1/responses/{id} returns
one, DELETE /v1/responses/{id} forgets it (a running one: cancel it first), and a request's
`previous_response_id` continues one (a background one once it has ended): its input (and
that of the responses it continued) and its output come before the new input, as history.
Instructions are not carried over, as OpenAI's are not. Off (the default), nothing is kept,
and previous_response_id and background are refused. Background runs, their events and
cancel: responses_background.py.
"""
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from kiln import envs
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.responses_protocol import ResponseInputItem

# Responses kept, the oldest forgotten first: a long-running server must not grow without end.
MAX_STORED = 10_000
ENV = "KILN_ENABLE_RESPONSES_API_STORE"
TURN_ON = f"{ENV}=1 (or vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)"


@dataclass
class _Stored:
    body: dict  # the response object as sent
    previous: "_Stored | None"  # the response it continued (kept alive by this link)
    input: list[ResponseInputItem]  # its own input items

    def history(self) -> list[ResponseInputItem]:
        """Its conversation so far: the continued responses' input and output, its input, then
        its output, as input items."""
        chain, node = [], self
        while node is not None:
            chain.append(node)
            node = node.previous
        items = []
        for node in reversed(chain):
            items += node.input
            items += [ResponseInputItem.model_validate(i) for i in _as_input(node.body["output"])]
        return items


def _as_input(output: list[dict]) -> list[dict]:
    """Output items as the input items that send them back."""
    items = []
    for o in output:
        if o["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": p["text"]} for p in o["content"]]})
        elif o["type"] == "reasoning":
            items.append({"type": "reasoning", "content": o["content"]})
        elif o["type"] == "function_call":
            items.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"Response with id {response_id!r} not found.", status=404, param=param,
                       code="response_not_found")


class ResponseStore:
    def __init__(self, enabled: bool | None = None, max_stored: int = MAX_STORED):
        self.enabled = envs.responses_api_store() if enabled is None else enabled
        self.max_stored = max_stored
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def check(self, req) -> _Stored | None:
        """The stored response `req.previous_response_id` continues (None without one); 404
        naming it where none is kept, 400 naming the variable where the store is off."""
        rid = req.previous_response_id
        if rid is None:
            return None
        if not self.enabled:
            raise OpenAIError(f"previous_response_id={rid!r} is refused: responses are not "
                              f"stored; start the server with {TURN_ON} to keep them,"
                              " or send the whole conversation in input",
                              param="previous_response_id", code="unsupported_parameter")
        stored = self._items.get(rid)
        if stored is None:
            raise not_found(rid, "previous_response_id")
        if running(stored.body):  # its output is not there yet: continuing it would drop it
            raise OpenAIError(f"previous_response_id={rid!r} is a background response still "
                              f"{stored.body['status']}: poll GET /v1/responses/{rid} until it "
                              "ends, then continue it", param="previous_response_id",
                              code="invalid_value")
        return stored

    def keeps(self, req) -> bool:
        """Whether the response to `req` is kept (and says store true): store on, not false."""
        return self.enabled and req.store is not False

    def put(self, body: dict, previous: _Stored | None,
            input: list[ResponseInputItem]) -> None:
        self._items[body["id"]] = _Stored(body, previous, input)
        self._items.move_to_end(body["id"])
        if len(self._items) > self.max_stored:
            # the oldest first, but never a background response still running: its task
            # stores its end there, and its client polls for it
            excess = len(self._items) - self.max_stored
            gone = itertools.islice((rid for rid, s in self._items.items()
                                     if not running(s.body)), excess)
            for rid in list(gone):
                del self._items[rid]

    def peek(self, response_id: str) -> dict | None:
        stored = self._items.get(response_id)
        return None if stored is None else stored.body

    def get(self, response_id: str) -> dict:
        stored = self._items.get(response_id)
        if stored is None:
            raise self._missing(response_id)
        return stored.body

    def delete(self, response_id: str) -> dict:
        if running(self.get(response_id)):
            raise OpenAIError(f"Response {response_id!r} is still running: cancel it first "
                              f"(POST /v1/responses/{response_id}/cancel), then delete it",
                              code="invalid_value")
        del self._items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def _missing(self, response_id: str) -> OpenAIError:
        error = not_found(response_id)
        if not self.enabled:
            error.message += (f" Responses are not stored: start the server with "
                              f"{TURN_ON} to keep them.")
        return error


def running(body: dict) -> bool:
    """A background response not yet ended."""
    return body["status"] in ("queued", "in_progress")
