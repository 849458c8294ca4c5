"""The Responses API's store, as vLLM keeps it with VLLM_ENABLE_RESPONSES_API_STORE=1 (Kiln:
KILN_ENABLE_RESPONSES_API_STORE, or vLLM's name): responses made with `store` (true by default)
are kept in this process's memory, bounded by count and by bytes (vLLM's store is unbounded:
KILN_RESPONSES_API_STORE_MAX_ENTRIES, default 10,000, and KILN_RESPONSES_API_STORE_MAX_BYTES,
default 1 GiB, of JSON: each response, its input, and the earlier ones a kept response continues
and so holds), the oldest finished forgotten first (never a background response still running:
one larger than the bound is not kept); GET /v1/responses/{id} returns
one, DELETE /v1/responses/{id} forgets it (a running one: cancel it first), and a request's
`previous_response_id` continues one (a background one once it has ended): its input (and
that of the responses it continued) and its output come before the new input, as history.
Instructions are not carried over, as OpenAI's are not. Off (the default), nothing is kept,
and previous_response_id and background are refused. Background runs, their events and
cancel: responses_background.py.
"""
from collections import OrderedDict
from dataclasses import dataclass

import pydantic_core

from kiln import envs
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.responses_protocol import ResponseInputItem

ENV = "KILN_ENABLE_RESPONSES_API_STORE"
TURN_ON = f"{ENV}=1 (or vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)"


@dataclass
class _Stored:
    body: dict  # the response object as sent
    previous: "_Stored | None"  # the response it continued (kept alive by this link)
    input: list[ResponseInputItem]  # its own input items
    size: int = 0  # bytes of its body's and input's JSON
    holders: int = 0  # its place in the store, and the responses held that continue it

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
    def __init__(self, enabled: bool | None = None, max_stored: int | None = None,
                 max_bytes: int | None = None):
        """`max_stored`, `max_bytes`: None reads their variables."""
        self.enabled = envs.responses_api_store() if enabled is None else enabled
        self.max_stored = envs.responses_api_store_max_entries() if max_stored is None \
            else max_stored
        self.max_bytes = envs.responses_api_store_max_bytes() if max_bytes is None \
            else max_bytes
        self.bytes = 0  # held: the responses in the store and those they continue
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
        rid = body["id"]
        size = len(pydantic_core.to_json(body)) + len(pydantic_core.to_json(input))
        stored = _Stored(body, previous, input, size)
        if rid in self._items:  # its namesake, or its own earlier state (a background one's)
            self._release(self._items.pop(rid))
        self._items[rid] = stored
        self._hold(stored)
        # the oldest first (this one last: one larger than max_bytes is not kept), but never
        # a background response still running: its task stores its end there, and its
        # client polls for it
        while len(self._items) > self.max_stored or self.bytes > self.max_bytes:
            gone = next((r for r, s in self._items.items() if not running(s.body)), None)
            if gone is None:
                break
            self._release(self._items.pop(gone))

    def _hold(self, stored: _Stored | None) -> None:
        """One more holder of `stored`: held now, its bytes count, and so do those of the
        responses it continues."""
        while stored is not None:
            stored.holders += 1
            if stored.holders > 1:
                return
            self.bytes += stored.size
            stored = stored.previous

    def _release(self, stored: _Stored | None) -> None:
        """One holder fewer: with none left, its bytes are free, and it holds its previous
        response no longer."""
        while stored is not None:
            stored.holders -= 1
            if stored.holders > 0:
                return
            self.bytes -= stored.size
            stored = stored.previous

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
        self._release(self._items.pop(response_id))
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
