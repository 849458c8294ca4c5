"""Response fields that account for a request, against the fake engine: `created`, the usage
streamed chunks carry (continuous_usage_stats) with n > 1, and the echo of a truncated prompt."""
import json
import types

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai import response_models, serving_chat, serving_completion
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
    for module in (response_models, serving_chat, serving_completion):
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


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings())) as c:
        yield c


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def test_continuous_usage_counts_each_completion_choice_apart(client):
    """n=2 over two prompts: a chunk's usage is its own prompt's tokens and its own choice's
    tokens so far (vLLM's), not running totals over every choice; the last chunk sums them."""
    events = sse_events(client, CMPL, dict(model=MODEL, prompt=["ab", "cdef"], n=2,
                                           max_tokens=3, stream_options=CONTINUOUS))
    seen: dict[int, int] = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + 1  # one token a chunk here
        prompt = 3 if choice["index"] < 2 else 5  # BOS + one id per character
        assert e["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen[choice["index"]],
                              "total_tokens": prompt + seen[choice["index"]]}
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4 * 3
    assert events[-1]["usage"]["prompt_tokens"] == 3 + 5


def test_continuous_usage_counts_each_chat_choice_apart_from_the_role_chunk_on(client):
    """The role chunk carries usage too (the prompt, nothing generated), as vLLM's."""
    events = sse_events(client, CHAT, {**BODIES[CHAT], "n": 2, "max_tokens": 3,
                                       "stream_options": CONTINUOUS})
    prompt = events[-1]["usage"]["prompt_tokens"]
    role = events[0]
    assert [c["delta"]["role"] for c in role["choices"]] == ["assistant", "assistant"]
    assert role["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0,
                             "total_tokens": prompt}
    seen: dict[int, int] = {}
    for e in events[1:-1]:
        (choice,) = e["choices"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + 1
        assert e["usage"]["prompt_tokens"] == prompt
        assert e["usage"]["completion_tokens"] == seen[choice["index"]]
    assert seen == {0: 3, 1: 3} and events[-1]["usage"]["completion_tokens"] == 2 * 3


def test_echo_of_a_truncated_prompt_is_the_text_of_its_kept_tokens(client):
    """truncate_prompt_tokens kept the prompt's BOS and last 3 characters: the echo is their
    text, so text, logprobs tokens and text_offset describe the same tokens; a prompt that fit
    whole is echoed as sent."""
    body = dict(model=MODEL, prompt="abcdefghij", max_tokens=2, truncate_prompt_tokens=4,
                echo=True, logprobs=0)
    whole = client.post(CMPL, json=body).json()
    (choice,) = whole["choices"]
    lp = choice["logprobs"]
    assert whole["usage"]["prompt_tokens"] == 4 and len(lp["tokens"]) == 4 + 2
    assert not choice["text"].startswith("abcdefghij")
    assert choice["text"] == "".join(lp["tokens"])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(6)]
    events = sse_events(client, CMPL, body)
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    fits = client.post(CMPL, json={**body, "prompt": "ab"}).json()["choices"][0]
    assert fits["text"].startswith("ab")
