"""The fake-engine HTTP tests' shared pieces: a module's client on a model-free engine, SSE
reading, OpenAI-style error checks, a thread spy."""
import json
import threading

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import FakeEngine

MODEL = "fake-model"


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    app = build_app(llm, ServerSettings(max_request_body_bytes=2000))
    with TestClient(app) as c:
        yield c


def sse_events(client, path, body, headers=None):
    with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_error(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def threads_calling(monkeypatch, module, name: str) -> list[str]:
    """The names of the threads that call module.name from now on (the list fills)."""
    threads = []
    real = getattr(module, name)

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(module, name, spy)
    return threads
