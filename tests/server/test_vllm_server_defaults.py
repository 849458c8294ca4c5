"""vLLM's server-default flags on `kiln serve`: --default-chat-template-kwargs,
--return-tokens-as-token-ids, --enable-force-include-usage, --enable-request-id-headers,
--disable-fastapi-docs, --max-log-len (taken, ignored)."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.cli.main import build_parser
from kiln.entrypoints.cli.serve import settings_from_args
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_api import MODEL, sse_events
from .fake_engine import FakeEngine

CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)


class KwargsEngine(FakeEngine):
    """Records the template variables each chat rendering got."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.template_kwargs: list[dict] = []

    def chat_prompt(self, messages, add_generation_prompt=True, **kw):
        self.template_kwargs.append(kw)
        return super().chat_prompt(messages, add_generation_prompt, **kw)


def _client(**settings):
    engine = KwargsEngine(max_model_len=64)
    return engine, TestClient(build_app(AsyncLLM(engine), ServerSettings(**settings)))


def test_the_flags_parse_into_the_settings():
    s = settings_from_args(build_parser().parse_args([
        "serve", "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--return-tokens-as-token-ids", "--enable-force-include-usage",
        "--enable-request-id-headers", "--disable-fastapi-docs", "--max-log-len", "100"]))
    assert s.default_chat_template_kwargs == {"enable_thinking": False}
    assert s.return_tokens_as_token_ids and s.enable_force_include_usage
    assert s.enable_request_id_headers and s.disable_fastapi_docs
    s = settings_from_args(build_parser().parse_args(["serve"]))
    assert s.default_chat_template_kwargs == {} and not s.return_tokens_as_token_ids


@pytest.mark.parametrize("value", ["[1]", "{bad", '{"messages": 1}', '{"chat_template": "x"}'])
def test_a_bad_default_chat_template_kwargs_names_the_flag(value):
    with pytest.raises(ValueError, match="--default-chat-template-kwargs"):
        settings_from_args(build_parser().parse_args(
            ["serve", "--default-chat-template-kwargs", value]))


def test_default_chat_template_kwargs_go_under_the_requests():
    engine, client = _client(default_chat_template_kwargs={"enable_thinking": False, "x": 1})
    with client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert engine.template_kwargs[-1]["enable_thinking"] is False
        body = {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert engine.template_kwargs[-1]["enable_thinking"] is True  # the request's win
        assert engine.template_kwargs[-1]["x"] == 1
        r = client.post("/tokenize", json={"model": MODEL, "messages": CHAT["messages"]})
        assert r.status_code == 200 and engine.template_kwargs[-1]["enable_thinking"] is False
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                               "max_output_tokens": 2})
        assert r.status_code == 200 and engine.template_kwargs[-1]["enable_thinking"] is False


def test_reasoning_effort_sets_enable_thinking_over_the_defaults_not_over_the_request():
    """vLLM's build_chat_params: reasoning_effort implies enable_thinking (off for "none")
    unless the request's own chat_template_kwargs set it; a server default does not count."""
    engine, client = _client(default_chat_template_kwargs={"enable_thinking": True})
    with client:
        for effort, given, thinking in (("none", None, False), ("minimal", None, True),
                                        ("none", {"enable_thinking": True}, True),
                                        ("max", {"enable_thinking": False}, False)):
            body = {**CHAT, "reasoning_effort": effort, "chat_template_kwargs": given}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            kw = engine.template_kwargs[-1]
            assert (kw["reasoning_effort"], kw["enable_thinking"]) == (effort, thinking), body
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert "reasoning_effort" not in engine.template_kwargs[-1]
        assert engine.template_kwargs[-1]["enable_thinking"] is True  # the default's, alone
        # /v1/responses' reasoning.effort is the same variable (vLLM's)
        for effort, thinking in (("none", False), ("high", True)):
            r = client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                   "max_output_tokens": 2,
                                                   "reasoning": {"effort": effort}})
            kw = engine.template_kwargs[-1]
            assert r.status_code == 200, r.text
            assert (kw["reasoning_effort"], kw["enable_thinking"]) == (effort, thinking)


def test_return_tokens_as_token_ids_is_the_default_a_request_can_turn_off():
    _, client = _client(return_tokens_as_token_ids=True)
    with client:
        lp = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
        assert lp["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
        lp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 2, "logprobs": 1}).json()
        assert lp["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        lp = client.post("/v1/chat/completions", json={
            **CHAT, "logprobs": True, "return_tokens_as_token_ids": False}).json()
        assert not lp["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})])
def test_force_include_usage_ends_every_stream_with_usage(path, body):
    _, client = _client(enable_force_include_usage=True)
    with client:
        events = sse_events(client, path, {**body, "stream": True})
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        assert all(not e.get("usage") for e in events[:-1])  # not continuous unless asked
        events = sse_events(client, path, {**body, "stream": True, "stream_options": {
            "include_usage": False, "continuous_usage_stats": True}})
        assert events[-1]["usage"]["completion_tokens"] == 3 and events[-2].get("usage")
        # a whole answer has its usage anyway; stream_options still needs stream=true
        assert client.post(path, json=body).json()["usage"]["completion_tokens"] == 3
        assert client.post(path, json={**body, "stream_options": {
            "include_usage": True}}).status_code == 400


def test_request_id_headers_and_no_docs():
    _, client = _client(enable_request_id_headers=True, disable_fastapi_docs=True)
    with client:
        assert len(client.get("/health").headers["x-request-id"]) == 32
        r = client.get("/health", headers={"X-Request-Id": "mine"})
        assert r.headers["x-request-id"] == "mine"
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert client.get(path).status_code == 404, path
    _, client = _client()
    with client:
        assert "x-request-id" not in client.get("/health").headers
        assert client.get("/openapi.json").status_code == 200


def test_the_requests_documents_field_wins_over_chat_template_kwargs_documents():
    """vLLM's build_chat_params merges documents over chat_template_kwargs (a None field
    leaves theirs); Kiln let the kwargs' documents win."""
    engine, client = _client()
    field, kwargs = [{"title": "f", "text": "field"}], [{"title": "k", "text": "kwargs"}]
    with client:
        for documents, want in ((field, field), (None, kwargs)):
            body = {**CHAT, "documents": documents,
                    "chat_template_kwargs": {"documents": kwargs, "x": 1}}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert engine.template_kwargs[-1]["documents"] == want, documents
            assert engine.template_kwargs[-1]["x"] == 1


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_chat_template_kwargs_tools_win_over_the_requests_tools_field():
    """vLLM merges the tools field into the server's template defaults, under the request's
    chat_template_kwargs: their non-null "tools" is what the template sees; a null there, or
    only the server's default, leaves the field's. Kiln let the field win."""
    field, kwargs, default = [_tool("f")], [_tool("k")], [_tool("d")]
    engine, client = _client(default_chat_template_kwargs={"tools": default})
    with client:
        for given, template_kwargs, want in (
                (field, {"tools": kwargs}, kwargs), (None, {"tools": kwargs}, kwargs),
                (field, {"tools": None}, field), (field, {}, field), (None, {}, default)):
            body = {**CHAT, "tools": given, "tool_choice": "none",
                    "chat_template_kwargs": {**template_kwargs, "x": 1}}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            seen = engine.template_kwargs[-1]
            assert [t["function"]["name"] for t in seen["tools"]] == \
                [t["function"]["name"] for t in want], (given, template_kwargs)
            assert seen["x"] == 1
