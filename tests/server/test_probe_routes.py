"""vLLM's probe and load routes: /ping (SageMaker's probe, GET or POST, as /health) and /load
(the completion and chat requests in flight, a stream until its last byte)."""
import json
import time

import httpx
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import FakeEngine
from .uvicorn_thread import uvicorn_in_thread


def test_ping_answers_as_health_and_takes_no_key():
    llm = AsyncLLM(FakeEngine())
    with TestClient(build_app(llm, ServerSettings(api_key="k"))) as c:
        for method in ("GET", "POST"):
            r = c.request(method, "/ping")
            assert r.status_code == 200 and r.content == b"", (method, r.text)
        assert c.get("/load").status_code == 401  # not a probe: keyed as the rest
        llm._refusing = "shutting down"  # as abort_all leaves it
        assert c.get("/ping").status_code == c.get("/health").status_code == 503


def _load(url: str) -> int:
    return httpx.get(f"{url}/load", timeout=10).json()["server_load"]


def test_load_counts_requests_until_their_last_byte():
    app = build_app(AsyncLLM(FakeEngine(max_model_len=256, step_delay=0.05)), ServerSettings())
    with uvicorn_in_thread(app) as port:
        url = f"http://127.0.0.1:{port}"
        assert _load(url) == 0
        body = {"prompt": "x", "max_tokens": 40, "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()  # one iterator: a dropped one closes the response
                first = next(lines)
                assert json.loads(first.removeprefix("data: "))["choices"]
                assert _load(url) == 1
                rest = list(lines)
            assert "data: [DONE]" in rest
            # A refused request and a disconnected one are counted out too.
            assert client.post(f"{url}/v1/completions", json={"prompt": "x", "n": 0}
                               ).status_code == 400
            with client.stream("POST", f"{url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
                    "stream": True}) as r:
                next(r.iter_lines())  # then hangs up
        deadline = time.monotonic() + 10
        while _load(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _load(url) == 0
