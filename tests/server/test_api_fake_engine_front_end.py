"""The HTTP layer against a fake engine (no model): /tokenize and /detokenize, work kept off the
event loop, /metrics, the heap frozen at start."""
import gc
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai import serving_tokenization
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.response_models import TokenizeResponse

from . import fake_api
from .fake_api import MODEL, assert_error, threads_calling
from .fake_engine import FakeEngine

client = fake_api.client  # the fixture: this module's client on a fake engine


def test_tokenize_detokenize(client):
    r = client.post("/tokenize", json=dict(prompt="ab", return_token_strs=True)).json()
    assert r["count"] == len(r["tokens"]) == 3 and r["max_model_len"] == 64
    assert len(r["token_strs"]) == 3
    chat = client.post("/tokenize", json=dict(messages=[{"role": "user", "content": "a"}])).json()
    assert chat["count"] > 3
    assert client.post("/detokenize", json=dict(tokens=[7, 8])).json() == {"prompt": "7 8 "}
    assert_error(client.post("/tokenize", json=dict(model=MODEL)), 400, "prompt")


def test_tokenize_body_is_built_on_a_front_end_thread(client, monkeypatch):
    # Not on the event loop: a huge prompt's ids would hold every stream's next token.
    threads = threads_calling(monkeypatch, serving_tokenization, "tokenize_response_json")
    assert client.post("/tokenize", json=dict(prompt="ab")).json()["count"] == 3
    client.post("/tokenize", json=dict(messages=[{"role": "user", "content": "a"}]))
    assert len(threads) == 2 and all(n.startswith("kiln-frontend") for n in threads), threads


@pytest.mark.parametrize("strs", [None, ["a", "b"]])
def test_tokenize_response_json_is_the_models_dump(strs):
    expected = TokenizeResponse(tokens=[5, 6], count=2, max_model_len=64,
                                token_strs=strs).model_dump(exclude_none=True)
    assert json.loads(serving_tokenization.tokenize_response_json([5, 6], 64, strs)) == expected


def _samples(client) -> dict:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0) + s.value
    return out


def test_metrics_parse_and_move(client):
    before = _samples(client)
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:kv_cache_usage_perc", "kiln:prompt_tokens_total",
                 "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_count",
                 "kiln:inter_token_latency_seconds_count"):
        assert name in before, name
    client.post("/v1/completions", json=dict(prompt="abc", max_tokens=4))
    after = _samples(client)
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] == 4
    assert after["kiln:prompt_tokens_total"] - before["kiln:prompt_tokens_total"] == 4
    assert after["kiln:time_to_first_token_seconds_count"] == \
        before["kiln:time_to_first_token_seconds_count"] + 1
    assert after["kiln:inter_token_latency_seconds_count"] == \
        before["kiln:inter_token_latency_seconds_count"] + 3
    assert after["kiln:num_requests_running"] == 0


def test_server_start_freezes_the_heap_out_of_the_collector():
    """The start-up heap is frozen once the engine starts: full collections on the event loop
    would otherwise rescan it (50-170 ms each under connection churn, every stream waiting)."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with TestClient(build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings())) as c:
        assert gc.get_freeze_count() > 0
        assert c.get("/health").status_code == 200


def test_a_chats_tools_are_read_off_the_event_loop(client, monkeypatch):
    """Their dicts for the template (and a forced call's schema) are built on a front-end
    thread: 20,000 tools held every other stream 1.4 s on the event loop."""
    from kiln.entrypoints.openai import serving_chat

    threads = threads_calling(monkeypatch, serving_chat, "plan_tools")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body in ({"tools": [tool], "tool_choice": "none"}, {}):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
    assert threads[0].startswith("kiln-frontend") and not threads[1].startswith("kiln-frontend")
