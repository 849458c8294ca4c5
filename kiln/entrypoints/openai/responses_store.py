"""The Responses API's store, as vLLM keeps it with VLLM_ENABLE_RESPONSES_API_STORE=1 (Kiln:
KILN_ENABLE_RESPONSES_API_STORE, or vLLM's name): responses made with `store` (true by default)
are kept in this process's memory, the newest MAX_STORED of them (vLLM's store is unbounded); GET
/v1/responses/{id} returns one (its stream=true refused), DELETE /v1/responses/{id} forgets it
(POST .../cancel: 400, as vLLM answers for a response that is not a background one), and a
request's `previous_response_id` continues one: its input (and that of the responses it
continued) and its output come before the new input, as history. Instructions are not carried
over, as OpenAI's are not. Off (the default), nothing is kept and previous_response_id is refused.
"""
from collections import OrderedDict
from dataclasses import dataclass

from kiln import envs
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.responses_protocol import ResponseInputItem

# Responses kept, the oldest forgotten first: a long-running server must not grow without end.
MAX_STORED = 10_000
ENV = "KILN_ENABLE_RESPONSES_API_STORE"
_TURN_ON = f"{ENV}=1 (or vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)"


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
                              f"stored; start the server with {_TURN_ON} to keep them,"
                              " or send the whole conversation in input",
                              param="previous_response_id", code="unsupported_parameter")
        stored = self._items.get(rid)
        if stored is None:
            raise not_found(rid, "previous_response_id")
        return stored

    def keeps(self, req) -> bool:
        """Whether the response to `req` is kept (and says store true): store on, not false."""
        return self.enabled and req.store is not False

    def put(self, body: dict, previous: _Stored | None,
            input: list[ResponseInputItem]) -> None:
        self._items[body["id"]] = _Stored(body, previous, input)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict:
        stored = self._items.get(response_id)
        if stored is None:
            raise self._missing(response_id)
        return stored.body

    def retrieve(self, response_id: str, stream: bool = False,
                 starting_after: int | None = None) -> dict:
        """GET /v1/responses/{id}. vLLM's stream=true (from event starting_after) replays a
        background response's events, and no response here has any: refused, where the body
        alone left the openai SDK's retrieve(stream=True) an empty stream."""
        body = self.get(response_id)
        if stream or starting_after is not None:
            param = "stream" if stream else "starting_after"
            raise OpenAIError(f"{param} is refused: it replays a background response's events, "
                              "and background responses are not supported; retrieve the "
                              "response without stream and starting_after", param=param,
                              code="unsupported_parameter")
        return body

    def delete(self, response_id: str) -> dict:
        if self._items.pop(response_id, None) is None:
            raise self._missing(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, response_id: str) -> None:
        """vLLM's POST /v1/responses/{id}/cancel: only a background response (none here: they
        are refused) can be cancelled; a kept one is finished."""
        self.get(response_id)
        raise OpenAIError("Cannot cancel a synchronous response: only background responses "
                          "can be cancelled, and background is not supported", status=400,
                          code="invalid_value")

    def _missing(self, response_id: str) -> OpenAIError:
        error = not_found(response_id)
        if not self.enabled:
            error.message += (f" Responses are not stored: start the server with "
                              f"{_TURN_ON} to keep them.")
        return error
