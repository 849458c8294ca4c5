"""A streamed chat whose tokens the tool parser turns into nothing (a call's text before it is
whole) sends no `"delta": {}` chunk for them, as vLLM's stream; their logprobs and token ids
go out with the next chunk rather than being lost (vLLM drops them)."""
import json

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_api import MODEL, sse_events
from .fake_engine import FakeEngine

# The model's text, token by token: a sentence, then one hermes tool call.
SCRIPT = ["Let", " me", " check", ".", "\n", "<tool_call>", "\n", '{"name', '": "', "get",
          "_weather", '", "', "arguments", '": {"', "city", '": "', "Paris", '"}}', "\n",
          "</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


class ScriptedEngine(FakeEngine):
    """Writes SCRIPT (its token ids as the fake's), then stops."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._k: dict[str, int] = {}  # request id -> its last token's place in SCRIPT

    def step(self):
        outputs = super().step()
        for out in outputs:
            for o in out.outputs:
                k = self._k[out.request_id] = self._k.get(out.request_id, -1) + 1
                o.text = SCRIPT[k]
                if o.finish_reason == "length" and k == len(SCRIPT) - 1:
                    o.finish_reason = "stop"
        return outputs


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(ScriptedEngine(max_model_len=64))
    settings = ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True)
    with TestClient(build_app(llm, settings)) as c:
        yield c


def _body(**kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                max_tokens=len(SCRIPT), stream=True, **kw)


def test_no_empty_delta_chunks_for_a_tool_call(client):
    events = sse_events(client, "/v1/chat/completions", _body())
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    empty = [c for c in choices[1:] if not c["delta"] and c["finish_reason"] is None]
    assert empty == [], f"{len(empty)} empty delta chunks of {len(choices)}"
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Let me check.\n"
    calls = [t for c in choices for t in c["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"]["arguments"] for t in calls)) == {"city": "Paris"}
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_skipped_tokens_logprobs_and_ids_go_out_with_the_next_chunk(client):
    """Every token's logprob and id still comes back once, in order, with no empty chunk."""
    events = sse_events(client, "/v1/chat/completions",
                        _body(logprobs=True, top_logprobs=1, return_token_ids=True,
                              stream_options={"include_usage": True}))
    choices = [c for e in events for c in e["choices"]]
    assert not [c for c in choices[1:] if not c["delta"] and c["finish_reason"] is None]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    logprobs = [lp for c in choices if c.get("logprobs") for lp in c["logprobs"]["content"]]
    assert len(ids) == len(logprobs) == len(SCRIPT) == events[-1]["usage"]["completion_tokens"]
    assert [lp["token"] for lp in logprobs] == [f"{t} " for t in ids]
