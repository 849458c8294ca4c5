"""Background responses under races a client can make (fake engine): a request_id sent by
several requests at once runs once, a foreground request never takes a running background
response's place in the store, a running one is not continued (previous_response_id)
before its output exists, and cancels that cross each other or the answer's end."""
import asyncio
import time

import httpx
from fastapi.testclient import TestClient

from .fake_api import assert_error
from .test_responses_background import SLOW, _app
from .uvicorn_thread import uvicorn_in_thread

LONG = dict(input="hi", max_output_tokens=200, background=True)


def test_one_request_id_sent_at_once_runs_once(monkeypatch):
    """The check before submit saw no namesake running for each of them: only one may start
    (the others' runs were lost from the server's view: uncancellable, past shutdown)."""
    app, engine = _app(monkeypatch, step_delay=SLOW)
    process = engine.process_inputs

    def slow_process(*args, **kwargs):  # each submit long enough for the others to come
        time.sleep(0.05)
        return process(*args, **kwargs)

    engine.process_inputs = slow_process

    async def post_all(base):
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*[c.post(base, json=dict(LONG, request_id="same"))
                                          for _ in range(6)])

    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}/v1/responses"
        answers = asyncio.run(post_all(base))
        assert sorted(r.status_code for r in answers) == [200] + [400] * 5, \
            [r.text for r in answers]
        for r in answers:
            if r.status_code == 400:
                assert_error(r, 400, "request_id")
        background = app.state.background_responses
        assert list(background.runs) == ["resp_same"]
        r = httpx.post(f"{base}/resp_same/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert not background.runs
        # the refused ones' requests were taken back: none runs on unseen
        assert not [r for r in engine.requests if r.startswith("resp_same")]


def test_a_foreground_namesake_does_not_replace_a_running_one(monkeypatch):
    app, _ = _app(monkeypatch, step_delay=SLOW)
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json=dict(LONG, request_id="r1")).json()["id"]
        err = assert_error(client.post("/v1/responses", json=dict(
            input="x", max_output_tokens=1, request_id="r1")), 400, "request_id")
        assert "still running" in err["message"]
        # one not kept cannot take its place: it may run
        assert client.post("/v1/responses", json=dict(
            input="x", max_output_tokens=1, request_id="r1", store=False)).status_code == 200
        body = client.get(f"/v1/responses/{rid}").json()
        assert body["background"] is True and body["status"] in ("queued", "in_progress")
        assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"


def test_a_running_one_is_not_continued_before_its_output_exists(monkeypatch):
    app, _ = _app(monkeypatch, step_delay=SLOW)
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json=LONG).json()["id"]
        err = assert_error(client.post("/v1/responses", json=dict(
            input="more", max_output_tokens=2, previous_response_id=rid)), 400,
            "previous_response_id")
        assert "still" in err["message"] and "poll" in err["message"]
        assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
        # ended (cancelled, with what it wrote): it may be continued
        r = client.post("/v1/responses", json=dict(input="more", max_output_tokens=2,
                                                   previous_response_id=rid))
        assert r.status_code == 200, r.text


def test_cancels_that_cross(monkeypatch):
    """Two cancels at once both answer the cancelled response; a cancel racing the answer's
    end answers whichever end was stored, never a 500."""
    app, _ = _app(monkeypatch, step_delay=SLOW)

    async def main(base):
        async with httpx.AsyncClient(timeout=30) as c:
            rid = (await c.post(base, json=LONG)).json()["id"]
            both = await asyncio.gather(*[c.post(f"{base}/{rid}/cancel") for _ in range(2)])
            short = []
            for _ in range(4):
                r = (await c.post(base, json=dict(LONG, max_output_tokens=2))).json()
                short.append(await c.post(f"{base}/{r['id']}/cancel"))
            return both, short

    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}/v1/responses"
        both, short = asyncio.run(main(base))
        assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
        assert both[0].json() == both[1].json() and both[0].json()["status"] == "cancelled"
        for r in short:
            assert r.status_code in (200, 400), r.text
            if r.status_code == 200:
                assert r.json()["status"] in ("cancelled", "incomplete")
        assert not app.state.background_responses.runs
