"""/v1/responses function-call items and the response store without a model: input items as
the chat messages they stand for, an "auto" answer's calls streamed as OpenAI's events (hermes'
<tool_call> text), and the store (KILN_ENABLE_RESPONSES_API_STORE) against the fake engine:
kept, retrieved, continued, deleted, bounded; refused with the variable named when off. A
forced call's schema nested too deep is a 400 naming tools on chat's route and this one."""
import json

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.responses_input import input_messages
from kiln.entrypoints.openai.responses_objects import EventWriter
from kiln.entrypoints.openai.responses_protocol import ResponsesRequest
from kiln.entrypoints.openai.responses_store import ResponseStore
from kiln.entrypoints.openai.responses_stream import StreamItems
from kiln.entrypoints.openai.responses_tools import call_items
from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kiln.entrypoints.openai.tool_parsers.base import ToolCallStream
from kiln.errors import ConfigError

from .fake_api import assert_error
from .fake_engine import FakeEngine, RecordingEngine, TextWritingEngine


def test_call_items_are_the_assistants_tool_calls_and_tool_messages():
    """A message then parallel calls (a response's output sent back) are one assistant turn;
    each output the tool message answering its call_id; reasoning before a call its thinking."""
    items = [{"role": "user", "content": "q"},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "let me see"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a":1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "two"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]
    messages, sources = input_messages(ResponsesRequest(input=items))
    shown = [(m.role, m.content if isinstance(m.content, str) else m.content[0].text,
              [c["id"] for c in m.tool_calls or []], m.tool_call_id, m.reasoning_content)
             for m in messages]
    assert shown == [("user", "q", [], None, None),
                     ("assistant", "let me see", ["c1", "c2"], None, None),
                     ("tool", "one", [], "c1", None), ("tool", "two", [], "c2", None),
                     ("assistant", "", ["c3"], None, "hm")]
    assert messages[1].tool_calls[1]["function"] == {"name": "g", "arguments": '{"a":1}'}
    assert sources == ["input[0]", "input[1]", "input[4]", "input[5]", "input[6]"]


def test_an_auto_answers_calls_stream_as_openais_events():
    """hermes' text, cut anywhere: the message then a function_call item per call, their
    argument deltas making each call's arguments, the final items those of the whole answer."""
    text = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
            '\n</tool_call>')
    content, calls = TOOL_PARSERS["hermes"]().extract(text)
    whole = call_items(calls)
    for size in (1, 3, 7, len(text)):
        items, tools = StreamItems(EventWriter()), ToolCallStream(TOOL_PARSERS["hermes"]())
        events = []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            said, deltas = tools.feed(piece, k == len(pieces) - 1)
            if said:
                events += items.text("message", said)
            events += items.tool_calls(deltas)
        events += items.finish("completed")
        events = [json.loads(e.split("data: ", 1)[1]) for e in events]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [o.type for o in items.output] == ["message", "function_call", "function_call"]
        assert items.output[0].content[0].text == content == "I will check."
        assert [(o.name, o.arguments, o.status) for o in items.output[1:]] == \
            [(c.name, c.arguments, "completed") for c in whole]
        for index, call in enumerate(items.output[1:], 1):
            mine = [e for e in events if e.get("output_index") == index]
            assert [e["type"] for e in mine][0] == "response.output_item.added"
            assert "".join(e["delta"] for e in mine
                           if e["type"] == "response.function_call_arguments.delta") == \
                call.arguments
            assert [e["type"] for e in mine][-2:] == [
                "response.function_call_arguments.done", "response.output_item.done"]
            assert mine[-2]["arguments"] == call.arguments and mine[-2]["name"] == call.name


def _client(monkeypatch, store: str | None):
    if store is None:
        monkeypatch.delenv("KILN_ENABLE_RESPONSES_API_STORE", raising=False)
    else:
        monkeypatch.setenv("KILN_ENABLE_RESPONSES_API_STORE", store)
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    return TestClient(build_app(AsyncLLM(FakeEngine(max_model_len=256)), ServerSettings()))


def test_the_store_keeps_retrieves_continues_and_deletes(monkeypatch):
    with _client(monkeypatch, "1") as client:
        first = client.post("/v1/responses", json=dict(input="hi", instructions="be brief",
                                                       max_output_tokens=3)).json()
        assert first["store"] is True
        assert client.get(f"/v1/responses/{first['id']}").json() == first
        # continued: the first's input and output, then the new input (its instructions are
        # not carried over, as OpenAI's are not)
        text = first["output"][0]["content"][0]["text"]
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text},
                   {"role": "user", "content": "more"}]
        body = dict(max_output_tokens=3, temperature=0)
        chained = client.post("/v1/responses", json=dict(
            previous_response_id=first["id"], input="more", **body)).json()
        sent = client.post("/v1/responses", json=dict(input=history, store=False,
                                                      **body)).json()
        assert chained["previous_response_id"] == first["id"] and sent["store"] is False
        assert chained["output"][0]["content"][0]["text"] == \
            sent["output"][0]["content"][0]["text"]
        assert chained["usage"]["input_tokens"] == sent["usage"]["input_tokens"]
        assert_error(client.get(f"/v1/responses/{sent['id']}"), 404, None,
                     "response_not_found")
        # streamed responses are kept too, as response.completed has them
        with client.stream("POST", "/v1/responses", json=dict(
                input="x", max_output_tokens=2, stream=True,
                previous_response_id=chained["id"])) as r:
            last = json.loads(r.read().decode().strip().split("data: ")[-1])["response"]
        assert client.get(f"/v1/responses/{last['id']}").json() == last
        # only background responses can be cancelled, as vLLM answers
        err = assert_error(client.post(f"/v1/responses/{first['id']}/cancel"), 400, None)
        assert "synchronous" in err["message"]
        assert client.delete(f"/v1/responses/{first['id']}").json() == \
            {"id": first["id"], "object": "response", "deleted": True}
        err = assert_error(client.get(f"/v1/responses/{first['id']}"), 404, None)
        assert first["id"] in err["message"]
        err = assert_error(client.post("/v1/responses", json=dict(
            previous_response_id="resp_gone", input="x")), 404, "previous_response_id",
            "response_not_found")
        assert "resp_gone" in err["message"]
        # a chain outlives the responses it continued
        r = client.post("/v1/responses", json=dict(previous_response_id=chained["id"],
                                                   input="x", max_output_tokens=2))
        assert r.status_code == 200, r.text
        assert client.delete("/v1/responses/resp_gone").status_code == 404
        assert client.post("/v1/responses/resp_gone/cancel").status_code == 404


def test_retrieving_a_stream_of_events_of_a_synchronous_response_is_refused(monkeypatch):
    """vLLM's GET stream=true replays a streamed background response's events (none for one
    made without background): the body alone left the openai SDK's retrieve(stream=True) an
    empty stream, silently."""
    with _client(monkeypatch, "1") as client:
        rid = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=2)).json()["id"]
        err = assert_error(client.get(f"/v1/responses/{rid}?stream=true"), 400, "stream",
                           "invalid_value")
        assert "background=true and stream=true" in err["message"]
        assert_error(client.get(f"/v1/responses/{rid}?starting_after=2"), 400, "starting_after")
        assert client.get(f"/v1/responses/{rid}?stream=false").json()["id"] == rid
        assert_error(client.get("/v1/responses/resp_gone?stream=true"), 404, None)
        assert_error(client.get(f"/v1/responses/{rid}?stream=maybe"), 400, "stream")


def test_the_store_is_bounded():
    """The oldest forgotten first, but never a background response still running."""
    store = ResponseStore(enabled=True, max_stored=2)
    store.put({"id": "bg", "status": "in_progress", "output": []}, None, [])
    for k in range(3):
        store.put({"id": f"r{k}", "status": "completed", "output": []}, None, [])
    for gone in ("r0", "r1"):
        with pytest.raises(Exception, match=gone):
            store.get(gone)
    assert [store.get(rid)["id"] for rid in ("bg", "r2")] == ["bg", "r2"]


def _body(rid: str, status: str = "completed", pad: int = 0) -> dict:
    return {"id": rid, "status": status, "output": [], "pad": "x" * pad}


def test_the_store_is_bounded_by_bytes():
    """Past max_bytes the oldest finished response is forgotten first (never a running one);
    one a kept response continues stays held, its bytes counted, until no
    kept response continues it."""
    size = len(json.dumps(_body("r0", pad=1000), separators=(",", ":"))) + 2  # + "[]" input
    store = ResponseStore(enabled=True, max_stored=100, max_bytes=3 * size)
    store.put(_body("bg", "queued", 1003), None, [])  # as long as a completed one
    for k in range(4):
        store.put(_body(f"r{k}", pad=1000), None, [])
    assert store.bytes <= 3 * size
    assert [rid for rid in ("bg", "r0", "r1", "r2", "r3") if store.peek(rid)] == \
        ["bg", "r2", "r3"]
    # r4 continues r3 (r2 forgotten for it); r3 deleted, but held by r4: its bytes count
    store.put(_body("r4", pad=1000), store.check(type("R", (), {
        "previous_response_id": "r3"})), [])
    assert store.peek("r2") is None
    store.delete("r3")
    assert store.bytes == 3 * size
    store.delete("r4")  # r3 held by nothing now
    assert store.bytes == size  # bg alone
    # one larger than the bound is not kept; a running one is never forgotten
    store.put(_body("big", pad=10 * size), None, [])
    assert store.peek("big") is None and store.peek("bg") and store.bytes == size


def test_the_stores_bounds_are_read_from_their_variables(monkeypatch):
    monkeypatch.setenv("KILN_RESPONSES_API_STORE_MAX_BYTES", "4096")
    monkeypatch.setenv("KILN_RESPONSES_API_STORE_MAX_ENTRIES", "7")
    store = ResponseStore(enabled=True)
    assert (store.max_bytes, store.max_stored) == (4096, 7)
    monkeypatch.setenv("KILN_RESPONSES_API_STORE_MAX_BYTES", "lots")
    with pytest.raises(ConfigError, match="KILN_RESPONSES_API_STORE_MAX_BYTES='lots'"):
        ResponseStore(enabled=True)


@pytest.mark.parametrize("store", [None, "0"])
def test_without_the_store_previous_response_id_names_the_variable(monkeypatch, store):
    with _client(monkeypatch, store) as client:
        r = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=2))
        assert r.json()["store"] is False
        err = assert_error(client.post("/v1/responses", json=dict(
            input="hi", previous_response_id=r.json()["id"])), 400, "previous_response_id",
            "unsupported_parameter")
        assert "KILN_ENABLE_RESPONSES_API_STORE=1" in err["message"]
        err = assert_error(client.get(f"/v1/responses/{r.json()['id']}"), 404, None)
        assert "KILN_ENABLE_RESPONSES_API_STORE=1" in err["message"]


def test_vllms_variable_turns_the_store_on(monkeypatch):
    monkeypatch.delenv("KILN_ENABLE_RESPONSES_API_STORE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    assert ResponseStore().enabled
    monkeypatch.setenv("KILN_ENABLE_RESPONSES_API_STORE", "0")  # Kiln's wins
    assert not ResponseStore().enabled


@pytest.mark.parametrize("parser, tool_choice, skip", [
    ("mistral", "auto", False), ("internlm", "auto", False), ("mistral", "none", True),
    ("hermes", "auto", True)])
def test_special_call_markers_are_decoded_on_responses_too(parser, tool_choice, skip):
    """mistral's [TOOL_CALLS] and internlm's <|action_start|> are special tokens: /v1/responses
    skipped them (chat kept them), so no function_call item could ever be read."""
    engine = RecordingEngine(max_model_len=64)
    settings = ServerSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    with TestClient(build_app(AsyncLLM(engine), settings)) as c:
        r = c.post("/v1/responses", json=dict(
            input="x", max_output_tokens=2, tool_choice=tool_choice,
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]))
    assert r.status_code == 200, r.text
    assert engine.params.skip_special_tokens is skip


@pytest.mark.parametrize("stream", [False, True])
def test_mistral_call_ids_are_ones_its_template_takes_back(stream):
    """Mistral's chat template raises on a tool call id that is not 9 alphanumerics; chat
    answers such ids, /v1/responses answered call_<24 hex>, so the function_call item sent
    back (the next turn) could never be rendered."""
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]'
    settings = ServerSettings(tool_call_parser="mistral", enable_auto_tool_choice=True)
    body = dict(input="x", max_output_tokens=1,
                tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    with TestClient(build_app(AsyncLLM(TextWritingEngine(text)), settings)) as c:
        if stream:
            with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ")]
            output = events[-1]["response"]["output"]
            added = [e["item"]["call_id"] for e in events
                     if e["type"] == "response.output_item.added"]
            assert added == [o["call_id"] for o in output]
        else:
            output = c.post("/v1/responses", json=body).json()["output"]
    ids = [o["call_id"] for o in output]
    assert [o["type"] for o in output] == ["function_call"] * 2
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2, ids


@pytest.mark.parametrize("stream", [False, True])
def test_max_tool_calls_keeps_the_first_calls(stream):
    """OpenAI's max_tool_calls: calls past it are ignored (it was refused). An "auto" answer
    keeps its first calls, whole and streamed; the response echoes the limit."""
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>')
    settings = ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = dict(input="x", max_output_tokens=1, max_tool_calls=2,
                tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    with TestClient(build_app(AsyncLLM(TextWritingEngine(text)), settings)) as c:
        if stream:
            with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ")]
            response = events[-1]["response"]
            added = [e["item"]["type"] for e in events
                     if e["type"] == "response.output_item.added"]
            assert added == ["function_call"] * 2
        else:
            response = c.post("/v1/responses", json=body).json()
    assert [(o["type"], o["arguments"]) for o in response["output"]] == \
        [("function_call", '{"a": 1}'), ("function_call", '{"a": 2}')]
    assert response["max_tool_calls"] == 2


def test_max_tool_calls_bounds_a_required_answers_grammar():
    """tool_choice "required": the grammar allows no more calls than max_tool_calls (and one
    without parallel calls); below 1 is a 400 pointing to tool_choice "none"."""
    engine = RecordingEngine(max_model_len=256)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    with TestClient(build_app(AsyncLLM(engine), ServerSettings())) as c:
        for extra, most in (({"max_tool_calls": 3}, 3),
                            ({"max_tool_calls": 3, "parallel_tool_calls": False}, 1), ({}, None)):
            r = c.post("/v1/responses", json=dict(input="x", max_output_tokens=2, tools=tools,
                                                   tool_choice="required", **extra))
            assert r.status_code == 200, r.text
            schema = json.loads(engine.params.structured_outputs.json) \
                if isinstance(engine.params.structured_outputs.json, str) \
                else engine.params.structured_outputs.json
            assert schema.get("maxItems") == most, extra
        r = c.post("/v1/responses", json=dict(input="x", tools=tools, max_tool_calls=0))
        assert "tool_choice" in assert_error(r, 400, "max_tool_calls", "invalid_value")["message"]


@pytest.mark.parametrize("tool_choice", ["required", "f"])
def test_a_forced_call_to_a_too_deep_schema_is_a_400_naming_tools(monkeypatch, tool_choice):
    """The forced call's grammar params refuse a schema nested past their limit: a 500 on both
    routes (a ValueError out of plan_tools), where response_format's is a 400."""
    deep = {"type": "object"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}}
    chat_choice = tool_choice if tool_choice == "required" else \
        {"type": "function", "function": {"name": "f"}}
    flat_choice = tool_choice if tool_choice == "required" else {"type": "function", "name": "f"}
    with _client(monkeypatch, None) as client:
        r = client.post("/v1/chat/completions", json=dict(
            messages=[{"role": "user", "content": "x"}], tool_choice=chat_choice,
            tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]))
        err = assert_error(r, 400, "tools", "invalid_value")
        assert "the schema of the tools' parameters nests" in err["message"]
        r = client.post("/v1/responses", json=dict(
            input="x", tool_choice=flat_choice,
            tools=[{"type": "function", "name": "f", "parameters": deep}]))
        assert_error(r, 400, "tools", "invalid_value")
