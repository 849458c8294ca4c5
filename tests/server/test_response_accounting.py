"""Response fields that account for a request, against the fake engine: `created`, the usage
streamed chunks carry (continuous_usage_stats) with n > 1, and the echo of a truncated prompt."""
import json
import types

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai import protocol, serving_chat, serving_completion
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import FakeEngine

MODEL = "fake-model"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BODIES = {CMPL: dict(model=MODEL, prompt="hello"),
          CHAT: dict(model=MODEL, messages=[{"role": "user", "content": "hello"}])}


def sse_events(client, path, body) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


class Clock:
    """Unix time as the handlers read it, moved on by the engine's steps."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


class SlowEngine(FakeEngine):
    """Each step that makes tokens takes 10 s of the clock."""

    def __init__(self, clock: Clock, **kw):
        super().__init__(**kw)
        self.clock = clock

    def step(self):
        outputs = super().step()
        if outputs:
            self.clock.now += 10
        return outputs


@pytest.fixture()
def clocked(monkeypatch):
    clock = Clock()
    for module in (protocol, serving_chat, serving_completion):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(time=clock.time))
    with TestClient(build_app(AsyncLLM(SlowEngine(clock)), ServerSettings())) as c:
        yield c, clock


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_created_is_the_requests_start_whole_and_streamed(clocked, path):
    """As vLLM's: when the request came in, not when the whole body was built after it."""
    c, clock = clocked
    start = int(clock.now)
    whole = c.post(path, json={**BODIES[path], "max_tokens": 3}).json()
    assert clock.now == start + 3 * 10
    assert whole["created"] == start
    start = int(clock.now)
    events = sse_events(c, path, {**BODIES[path], "max_tokens": 3})
    assert {e["created"] for e in events} == {start}
