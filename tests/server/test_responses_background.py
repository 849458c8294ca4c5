"""Background responses on /v1/responses against the fake engine: queued at once, polled to the
answer a foreground request gets, cancelled mid-run (with what they wrote), a streamed one's
events replayed from any point, a client that hangs up aborting nothing, the server's shutdown
ending them, the store's bound; refused naming the variable without the store."""
import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.responses_background import EventLog

from .fake_api import assert_error
from .fake_engine import FakeEngine
from .uvicorn_thread import uvicorn_in_thread

SLOW = 0.02  # s a step: a 200-token answer runs for seconds, time enough to act on it


def _app(monkeypatch, store: str | None = "1", step_delay: float = 0.0):
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    if store is None:
        monkeypatch.delenv("KILN_ENABLE_RESPONSES_API_STORE", raising=False)
    else:
        monkeypatch.setenv("KILN_ENABLE_RESPONSES_API_STORE", store)
    engine = FakeEngine(max_model_len=256, step_delay=step_delay)
    return build_app(AsyncLLM(engine), ServerSettings()), engine


def _poll(client, rid: str, until=lambda b: b["status"] not in ("queued", "in_progress")):
    deadline = time.monotonic() + 30
    while True:
        body = client.get(f"/v1/responses/{rid}").json()
        if until(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.01)


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ")]


def test_polled_to_the_answer_a_foreground_request_gets(monkeypatch):
    app, _ = _app(monkeypatch)
    body = dict(input="hi", instructions="be brief", max_output_tokens=5, temperature=0)
    with TestClient(app) as client:
        fore = client.post("/v1/responses", json=body).json()
        r = client.post("/v1/responses", json=dict(body, background=True))
        assert r.status_code == 200, r.text
        queued = r.json()
        assert queued["status"] == "queued" and queued["background"] is True
        assert queued["output"] == [] and queued["usage"] is None and queued["store"] is True
        done = _poll(client, queued["id"])
        # ended as the foreground one did (cut at max_output_tokens: incomplete)
        assert done["status"] == fore["status"] == "incomplete" and done["background"] is True
        assert done["output"] == [dict(o, id=d["id"]) for o, d in zip(fore["output"],
                                                                       done["output"])]
        assert done["usage"] == fore["usage"] and fore["background"] is False
        # a finished one is no longer cancellable; a foreground one never was
        err = assert_error(client.post(f"/v1/responses/{done['id']}/cancel"), 400, None)
        assert "incomplete" in err["message"]
        err = assert_error(client.post(f"/v1/responses/{fore['id']}/cancel"), 400, None)
        assert "synchronous" in err["message"]
        # and continued as any stored response
        r = client.post("/v1/responses", json=dict(input="more", max_output_tokens=2,
                                                   previous_response_id=done["id"]))
        assert r.status_code == 200, r.text


def test_cancelled_mid_run(monkeypatch):
    app, engine = _app(monkeypatch, step_delay=SLOW)
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json=dict(
            input="hi", max_output_tokens=200, background=True)).json()["id"]
        # running: not deletable, not evicted; its id may not be reused meanwhile
        err = assert_error(client.delete(f"/v1/responses/{rid}"), 400, None)
        assert "cancel it first" in err["message"]
        err = assert_error(client.post("/v1/responses", json=dict(
            input="hi", background=True, request_id=rid.removeprefix("resp_"))), 400,
            "request_id")
        assert "still running" in err["message"]
        assert _poll(client, rid, lambda b: b["status"] == "in_progress")["status"] == \
            "in_progress"
        r = client.post(f"/v1/responses/{rid}/cancel")
        assert r.status_code == 200, r.text
        cancelled = r.json()
        assert cancelled["status"] == "cancelled" and cancelled["background"] is True
        assert cancelled["usage"] is not None  # stored by its run, with what it wrote
        assert any(a.startswith(rid) for a in engine.aborted)  # the engine stopped it
        assert client.get(f"/v1/responses/{rid}").json() == cancelled
        # OpenAI's: cancelling twice returns the cancelled response
        assert client.post(f"/v1/responses/{rid}/cancel").json() == cancelled
        assert client.delete(f"/v1/responses/{rid}").json()["deleted"] is True


@pytest.mark.parametrize("store", [None, "0"])
def test_refused_without_the_store_naming_the_variable(monkeypatch, store):
    app, engine = _app(monkeypatch, store)
    with TestClient(app) as client:
        err = assert_error(client.post("/v1/responses", json=dict(input="hi", background=True)),
                           400, "background", "unsupported_parameter")
        assert "KILN_ENABLE_RESPONSES_API_STORE=1" in err["message"]
        assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in err["message"]
    assert engine.requests == {} and engine.aborted == []  # nothing ran


def test_store_false_is_refused(monkeypatch):
    app, engine = _app(monkeypatch)
    with TestClient(app) as client:
        assert_error(client.post("/v1/responses", json=dict(input="hi", background=True,
                                                           store=False)), 400, "store")
    assert engine.aborted == []


def test_a_streamed_ones_events_replay_from_any_point(monkeypatch):
    app, _ = _app(monkeypatch)
    with TestClient(app) as client:
        with client.stream("POST", "/v1/responses", json=dict(
                input="hi", max_output_tokens=4, background=True, stream=True)) as r:
            sent = r.read().decode()
        events = _events(sent)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        # OpenAI's order for a background stream: created and queued (both queued), then
        # in_progress
        assert [e["type"] for e in events[:3]] == ["response.created", "response.queued",
                                                   "response.in_progress"]
        assert [e["response"]["status"] for e in events[:3]] == ["queued", "queued",
                                                                  "in_progress"]
        assert events[-1]["type"] == "response.completed"
        rid = events[-1]["response"]["id"]
        assert client.get(f"/v1/responses/{rid}").json() == events[-1]["response"]
        assert client.get(f"/v1/responses/{rid}?stream=true").text == sent
        after = _events(client.get(f"/v1/responses/{rid}?stream=true&starting_after=3").text)
        assert after == events[4:]
        assert client.get(f"/v1/responses/{rid}?stream=true&starting_after=999").text == ""
        assert_error(client.get(f"/v1/responses/{rid}?stream=true&starting_after=-2"), 400,
                     "starting_after")
        assert_error(client.get(f"/v1/responses/{rid}?starting_after=1"), 400,
                     "starting_after")
        # one made without stream has no events to replay
        plain = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=2,
                                                       background=True)).json()["id"]
        err = assert_error(client.get(f"/v1/responses/{plain}?stream=true"), 400, "stream")
        assert "stream=true" in err["message"]
        assert_error(client.get("/v1/responses/resp_gone?stream=true"), 404, None)


def test_a_client_that_hangs_up_aborts_nothing(monkeypatch):
    """The stream's reader gone after three events, the response runs on to its end, and a
    new reader follows it from where the first stopped."""
    app, engine = _app(monkeypatch, step_delay=SLOW)
    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}/v1/responses"
        with httpx.stream("POST", base, json=dict(input="hi", max_output_tokens=40,
                                                  background=True, stream=True),
                          timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = [json.loads(next(lines)[len("data: "):]) for _ in range(3)]
        rid = first[0]["response"]["id"]
        rest = _events(httpx.get(f"{base}/{rid}?stream=true&starting_after=2",
                                 timeout=30).text)
        assert rest[0]["sequence_number"] == 3 and rest[-1]["type"] == "response.completed"
        done = httpx.get(f"{base}/{rid}").json()
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 40
    assert not any(a.startswith(rid) for a in engine.aborted)


@pytest.mark.parametrize("stream", [False, True])
def test_one_the_engine_fails_is_failed_with_why(monkeypatch, stream):
    app, engine = _app(monkeypatch)
    engine.fail_next_step = True
    with TestClient(app) as client:
        r = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=5,
                                                   background=True, stream=stream))
        assert r.status_code == 200, r.text
        rid = _events(r.text)[0]["response"]["id"] if stream else r.json()["id"]
        failed = _poll(client, rid)
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_dead"
    assert "injected engine failure" in failed["error"]["message"]


def test_the_servers_shutdown_ends_them(monkeypatch):
    """Still running when the server stops: each ends cancelled, stored with what it wrote,
    a streamed one's events closed; nothing waits for them to finish."""
    app, engine = _app(monkeypatch, step_delay=SLOW)
    body = dict(input="hi", max_output_tokens=200, background=True)
    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}/v1/responses"
        plain = httpx.post(base, json=body, timeout=30).json()["id"]
        with httpx.stream("POST", base, json=dict(body, stream=True), timeout=30) as r:
            line = next(line for line in r.iter_lines() if line.startswith("data: "))
        streamed = json.loads(line[len("data: "):])["response"]["id"]
    background = app.state.background_responses
    assert [background.store.get(rid)["status"] for rid in (plain, streamed)] == \
        ["cancelled", "cancelled"]
    assert background.logs[streamed].done and not background.runs and engine.shut_down


def test_the_store_bounds_those_running_and_never_forgets_one(monkeypatch):
    app, _ = _app(monkeypatch, step_delay=SLOW)
    with TestClient(app) as client:
        app.state.background_responses.store.max_stored = 1
        rid = client.post("/v1/responses", json=dict(input="hi", max_output_tokens=200,
                                                     background=True)).json()["id"]
        err = assert_error(client.post("/v1/responses", json=dict(
            input="hi", background=True)), 429, "background", "too_many_background_responses")
        assert "(1, the response store's bound)" in err["message"]
        # a foreground response kept past the bound is forgotten, not the running one
        fore = client.post("/v1/responses", json=dict(input="x", max_output_tokens=1)).json()
        assert client.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress")
        assert client.get(f"/v1/responses/{fore['id']}").status_code == 404
        assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"


def test_an_event_log_wakes_every_reader():
    async def main():
        log = EventLog()

        async def read(start):
            return [e async for e in log.follow(start)]

        readers = [asyncio.ensure_future(read(k)) for k in (0, 0, 1)]
        await asyncio.sleep(0)
        for e in "abc":
            log.append(e)
            await asyncio.sleep(0)
        log.close()
        return [await r for r in readers]

    assert asyncio.run(main()) == [list("abc"), list("abc"), list("bc")]


@pytest.mark.parametrize("grace_s, status", [(30.0, "incomplete"), (0.1, "cancelled")])
def test_the_grace_period_waits_for_them(monkeypatch, grace_s, status):
    """serve()'s stop: a background response holds no connection, yet it gets the grace
    period as requests do (it ends on its own: incomplete at its limit), aborted at its end."""
    import threading

    import uvicorn

    from kiln.entrypoints.openai.server_lifecycle import _Server
    from kiln.executor.free_port import free_port

    app, _ = _app(monkeypatch, step_delay=SLOW)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=grace_s + 5)
    server = _Server(config, app.state.llm, grace_s, lambda: None)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    rid = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=dict(
        input="hi", max_output_tokens=20 if status == "incomplete" else 200,
        background=True), timeout=30).json()["id"]
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive()
    assert app.state.background_responses.store.get(rid)["status"] == status
