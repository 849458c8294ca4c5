"""/v1/responses against the fake engine: the response object's and the event stream's shapes,
what is refused (400 naming the field), a client leaving mid-stream, concurrent streams."""
import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.responses_input import input_messages
from kiln.entrypoints.openai.responses_protocol import ResponsesRequest

from .fake_api import assert_error
from .fake_engine import FakeEngine
from .uvicorn_thread import uvicorn_in_thread

MODEL = "fake-model"


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    app = build_app(llm, ServerSettings(max_request_body_bytes=4000))
    with TestClient(app) as c:
        yield c


def events(client, body) -> list[dict]:
    """The stream's events, each checked: `event:` names the data's type, numbers count up."""
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        assert event["sequence_number"] == len(out)
        out.append(event)
    return out


def test_whole_response_shape(client):
    body = dict(model=MODEL, input="hi", instructions="be brief", max_output_tokens=4,
                metadata={"k": "v"}, user="u1", temperature=0.0, top_p=0.5)
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["id"].startswith("resp_") and resp["object"] == "response"
    assert abs(resp["created_at"] - time.time()) < 60
    assert (resp["model"], resp["instructions"], resp["metadata"], resp["user"]) == \
        (MODEL, "be brief", {"k": "v"}, "u1")
    assert (resp["temperature"], resp["top_p"], resp["max_output_tokens"]) == (0.0, 0.5, 4)
    assert resp["store"] is False and resp["tools"] == [] and resp["truncation"] == "disabled"
    # max_output_tokens reached: incomplete, as OpenAI says it
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = resp["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["status"] == "incomplete"
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    assert len(part["text"].split()) == 4
    usage = resp["usage"]
    assert usage["output_tokens"] == 4 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    # The same conversation sent as items (instructions as a system message's place) renders
    # the same prompt: the same answer.
    items = [{"role": "system", "content": "be brief"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "hi"}]}]
    again = client.post("/v1/responses", json={**body, "instructions": None,
                                              "input": items}).json()
    assert again["output"][0]["content"][0]["text"] == part["text"]
    assert again["usage"]["input_tokens"] == usage["input_tokens"]


def test_answers_as_chat_does(client):
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    chat = client.post("/v1/chat/completions", json=dict(
        messages=messages, max_tokens=6, temperature=0)).json()
    items = [{**m, "content": [{"type": "output_text" if m["role"] == "assistant"
                                else "input_text", "text": m["content"]}]} for m in messages]
    resp = client.post("/v1/responses", json=dict(input=items, max_output_tokens=6,
                                                   temperature=0)).json()
    assert resp["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_reasoning_items_sent_back_are_the_thinking(client):
    """A response's output sent back as history (OpenAI's and vLLM's conversation examples:
    `input += response.output`) holds its reasoning item: the thinking of the assistant turn
    after it, as chat's reasoning_content; alone, an assistant turn of its own (as vLLM's)."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "think"}]}
    answer = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "a", "annotations": [],
                          "logprobs": []}]}
    items = [{"role": "user", "content": "q"}, reasoning, answer,
             {"role": "user", "content": "q2"}, {**reasoning, "content": None,
                                                 "summary": [{"type": "summary_text",
                                                              "text": "s"}]}]
    messages, sources = input_messages(ResponsesRequest(input=items, instructions="i"))
    assert [(m.role, m.content if isinstance(m.content, str) else m.content[0].text,
             m.reasoning_content) for m in messages] == [
        ("system", "i", None), ("user", "q", None),
        ("assistant", "a", "think"), ("user", "q2", None),
        ("assistant", "", "s")]
    assert sources == ["instructions", "input[0]", "input[2]", "input[3]", "input[4]"]
    chat = client.post("/v1/chat/completions", json=dict(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "think"},
        {"role": "user", "content": "q2"}], max_tokens=6, temperature=0)).json()
    r = client.post("/v1/responses", json=dict(input=items[:4], max_output_tokens=6,
                                               temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == \
        chat["choices"][0]["message"]["content"]
    assert r.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_stream_event_sequence(client):
    body = dict(input="hello", max_output_tokens=5, metadata={"a": "b"})
    whole = client.post("/v1/responses", json=body).json()
    evs = events(client, body)
    types = [e["type"] for e in evs]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 5,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    rid = evs[0]["response"]["id"]
    assert all(e["response"]["id"] == rid for e in evs if "response" in e)
    item_id = evs[2]["item"]["id"]
    assert evs[2]["item"]["status"] == "in_progress" and evs[2]["output_index"] == 0
    assert evs[3]["part"] == {"type": "output_text", "text": "", "annotations": [],
                              "logprobs": []}
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert all(e["item_id"] == item_id and e["content_index"] == 0 for e in deltas)
    text = "".join(e["delta"] for e in deltas)
    assert text == evs[-4]["text"] == evs[-3]["part"]["text"] == \
        whole["output"][0]["content"][0]["text"]
    final = evs[-1]["response"]
    assert final["status"] == "incomplete" and final["metadata"] == {"a": "b"}
    assert final["output"][0] == evs[-2]["item"]
    assert final["output"][0]["id"] == item_id and final["output"][0]["status"] == "incomplete"
    assert final["usage"] == whole["usage"]


BAD = [
    ({"input": []}, "input", "invalid_value"),
    ({"input": 5}, "input", None),
    ({"input": [5]}, "input[0]", None),
    ({}, "input", "missing"),
    ({"input": [{"type": "item_reference", "id": "fc_1"}]}, "input[0].type",
     "unsupported_content"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input[0].encrypted_content", "unsupported_content"),
    ({"input": [{"type": "reasoning", "summary": [], "content": "t"}]}, "input[0].content",
     "invalid_value"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}],
                 "content": [{"type": "reasoning_text", "text": "t"}]}]},
     "input[0].summary[0].text", "invalid_value"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].content", "invalid_value"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", None),
    ({"input": [{"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[1].content[0].type", "unsupported_content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
      "instructions": "s"}, "input[0].content[0].type", "unsupported_content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens",
     "context_length_exceeded"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "temperature": -1}, "temperature", None),
    ({"input": "hi", "top_p": 0}, "top_p", None),
    ({"input": "x" * 80}, "input", "context_length_exceeded"),
    ({"input": "hi", "model": "other"}, "model", "model_not_found"),
    # "auto" (the default) needs the server's tool parser
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tool_choice",
     "invalid_value"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type",
     "unsupported_parameter"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}, {"type": "mcp"}]},
     "tools[1].type", "unsupported_parameter"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name", "invalid_value"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "integer"}}], "tool_choice": "required"}, "tools", "invalid_value"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "invalid_value"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_parameter"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments", "invalid_value"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "invalid_value"),
    # an output answering no call before it (vLLM's "No call message found"): none, another
    # call's id, or its call only after it
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].call_id", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "d", "output": "x"}]},
     "input[1].call_id", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "invalid_value"),
    ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id",
     "unsupported_parameter"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": "hi", "background": True}, "background", "unsupported_parameter"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include",
     "unsupported_parameter"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary",
     "unsupported_parameter"),
    ({"input": "hi", "reasoning": {"effort": "maximum"}}, "reasoning.effort", "invalid_value"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"input": "hi", "text": {"verbosity": "high"}}, "text.verbosity", "unsupported_parameter"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", None),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format",
     "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n",
                                         "schema": {"type": "bogus"}}}}, "text.format",
     "invalid_value"),
    ({"input": "hi", "stream_options": {}}, "stream_options", "invalid_value"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k", None),
]


@pytest.mark.parametrize("body,param,code", BAD)
def test_refused_naming_the_field(client, body, param, code):
    assert_error(client.post("/v1/responses", json=body), 404 if param == "model" else 400,
                 param, code)


@pytest.mark.parametrize("raw,param", [
    ('{"input": "hi", "instructions": "\\ud800"}', "instructions"),
    ('{"input": "\\udc00"}', "input"),  # the body's own path (a string input)
    ('{"input": "hi", "instructions": "s", "input": [{"role": "user", "content": "\\udc00"}]}',
     "input[0].content"),
    # after a reasoning item merged into the assistant turn, an item is named at its place
    ('{"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], '
     '"content": [{"type": "reasoning_text", "text": "t"}]}, {"role": "assistant", '
     '"content": "a"}, {"role": "user", "content": "\\udc00"}]}', "input[3].content")])
def test_chat_errors_name_the_responses_field(client, raw, param):
    r = client.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param)
    assert "messages" not in err["message"]


def test_accepted_no_effect_fields(client):
    """OpenAI's default store=true (nothing is stored: the response says false, as vLLM's),
    tool_choice "none" / "auto" without tools, an empty reasoning object, truncation
    "disabled": answered, not refused."""
    r = client.post("/v1/responses", json=dict(
        input="hi", max_output_tokens=2, store=True, tool_choice="none", reasoning={},
        truncation="disabled", parallel_tool_calls=False, service_tier="auto"))
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False and r.json()["parallel_tool_calls"] is False


def test_text_format_is_echoed(client):
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    r = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=2,
                                               text={"format": fmt}))
    assert r.status_code == 200, r.text
    assert r.json()["text"] == {"format": fmt}


def test_openapi_describes_the_route(client):
    schema = client.get("/openapi.json").json()
    op = schema["paths"]["/v1/responses"]["post"]
    ok = op["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponsesResponse"}
    assert "text/event-stream" in ok and "400" in op["responses"]
    inp = schema["components"]["schemas"]["ResponsesRequest"]["properties"]["input"]
    assert {"type": "string"} in inp["anyOf"]


def test_client_leaving_mid_stream_aborts_and_others_are_undisturbed():
    engine = FakeEngine(max_model_len=4096, step_delay=0.01)
    app = build_app(AsyncLLM(engine), ServerSettings())
    with uvicorn_in_thread(app) as port:
        url = f"http://127.0.0.1:{port}/v1/responses"
        solo = {p: httpx.post(url, json=dict(input=p, max_output_tokens=12)).json()
                ["output"][0]["content"][0]["text"] for p in ("a", "bb", "ccc", "dddd")}

        async def stream(prompt: str) -> str:
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", url, json=dict(input=prompt, max_output_tokens=12,
                                                           stream=True)) as r:
                    text = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            e = json.loads(line[6:])
                            text += e.get("delta", "")
                    return text

        async def leaver() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", url, json=dict(input="zz", max_output_tokens=3000,
                                                           stream=True)) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == 6:
                            return  # mid-stream: the connection closes

        async def main():
            return await asyncio.gather(leaver(), *(stream(p) for p in solo))

        _, *texts = asyncio.run(main())
        assert texts == list(solo.values())
        deadline = time.monotonic() + 10
        while not any(r.startswith("resp_") for r in engine.aborted):
            assert time.monotonic() < deadline, "the left stream's request was not aborted"
            time.sleep(0.05)
        assert not engine.requests


def test_engine_death_while_streaming_is_an_error_event():
    """OpenAI's error event (type "error", code, message, param, its sequence number) ends the
    stream, with the code a whole request's 503 has."""
    llm = AsyncLLM(FakeEngine(step_delay=0.01))
    with TestClient(build_app(llm, ServerSettings())) as c:
        llm.engine.fail_next_step = True
        r = c.post("/v1/responses", json=dict(input="x", max_output_tokens=5, stream=True))
        blocks = r.text.strip().split("\n\n")
        last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
        assert blocks[-1].startswith("event: error\n")
        assert last["type"] == "error" and last["code"] == "engine_dead" and last["message"]
        assert last["sequence_number"] == len(blocks) - 1 and "param" in last
        assert not any("response.completed" in b for b in blocks)


def test_items_are_read_on_a_front_end_thread(client, monkeypatch):
    """Not on the event loop: 20,000 items took 0.3 s of Python there, every stream waiting. An
    item's type may be absent or null (a message)."""
    from kiln.entrypoints.openai import serving_responses

    from .fake_api import threads_calling

    threads = threads_calling(monkeypatch, serving_responses, "input_messages")
    items = [{"role": "user", "content": "a"}, {"type": None, "role": "user", "content": "b"}]
    r = client.post("/v1/responses", json=dict(input=items, max_output_tokens=1))
    assert r.status_code == 200, r.text
    assert len(threads) == 1 and threads[0].startswith("kiln-frontend"), threads


class _GrammarFailing(FakeEngine):
    """Ends every constrained sample with the core's grammar failure."""

    def step(self):
        outs = super().step()
        for out in outs:
            for o in out.outputs:
                o.error = "structured_outputs.json allows no token after 1 generated token(s)"
        return outs


def test_a_grammar_failure_names_text_format():
    """A grammar the engine gives up on names the field the client sent, text.format (chat's
    response_format is no field of this API), collected and streamed."""
    with TestClient(build_app(AsyncLLM(_GrammarFailing()), ServerSettings())) as c:
        body = dict(input="x", max_output_tokens=5, text={"format": {
            "type": "json_schema", "name": "n", "schema": {"type": "object"}}})
        err = assert_error(c.post("/v1/responses", json=body), 400, "text.format",
                           "request_failed")
        assert "response_format" not in err["message"]
        r = c.post("/v1/responses", json={**body, "stream": True})
        last = json.loads(r.text.strip().split("\n\n")[-1].split("\n")[1][6:])
        assert last["type"] == "error" and last["param"] == "text.format", last


def test_load_counts_a_responses_stream():
    """GET /load (vLLM's server_load) counts /v1/responses as it counts completions and chat."""
    app = build_app(AsyncLLM(FakeEngine(max_model_len=256, step_delay=0.05)), ServerSettings())
    with uvicorn_in_thread(app) as port:
        url = f"http://127.0.0.1:{port}"
        body = {"input": "x", "max_output_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: response.created"
            assert httpx.get(f"{url}/load").json()["server_load"] == 1
            list(lines)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/load").json()["server_load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/load").json()["server_load"] == 0
