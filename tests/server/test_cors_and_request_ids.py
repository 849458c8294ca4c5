"""Browsers and request ids on a fake engine: CORS as vLLM answers it (a preflight needs no key),
the CORS flags, and a client's X-Request-Id naming the response."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import FakeEngine
from .test_hardening import AUTH, KEY
from .uvicorn_thread import uvicorn_in_thread


def test_cors_as_vllm_answers_it_and_a_preflight_needs_no_key():
    """Browsers on another origin were refused (no CORS headers; OPTIONS was a 405), while vLLM
    allows every origin by default. The key still guards the calls themselves."""
    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY))
    origin = {"Origin": "https://app.example"}
    with TestClient(app) as c:
        pre = c.options("/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        r = c.get("/v1/models", headers={**origin, **AUTH})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert c.get("/v1/models", headers=origin).status_code == 401
    only = build_app(AsyncLLM(FakeEngine()), ServerSettings(allowed_origins=["https://a.b"]))
    with TestClient(only) as c:
        r = c.get("/v1/models", headers=origin)
        assert "access-control-allow-origin" not in r.headers


def test_the_clients_x_request_id_names_the_response_and_comes_back():
    """vLLM takes X-Request-Id as the request's id; the OpenAI SDK reads it off the response."""
    with TestClient(build_app(AsyncLLM(FakeEngine()), ServerSettings())) as c:
        for path, body, prefix in (("/v1/completions", dict(prompt="x", max_tokens=1), "cmpl"),
                                   ("/v1/chat/completions", dict(
                                       messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1), "chatcmpl")):
            r = c.post(path, json=body, headers={"X-Request-Id": "my-req-1"})
            assert r.json()["id"] == f"{prefix}-my-req-1" and \
                r.headers["x-request-id"] == "my-req-1"
            assert "x-request-id" not in c.post(path, json=body).headers


def test_a_clients_id_may_come_again_while_its_namesake_runs():
    """Ids went to the engine as the client gave them: a retry with a proxy's X-Request-Id was
    a 400 ('already in flight', naming a request_id never sent), and one sent just after an
    abort got its namesake's leftover tokens (helper-54). The engine's ids are the client's plus
    a random suffix, as vLLM's."""
    import httpx

    header = {"X-Request-Id": "same"}
    body = dict(prompt="x", max_tokens=40, stream=True)
    engine = FakeEngine(step_delay=0.05)  # 2 s for the first: still running at the second
    with uvicorn_in_thread(build_app(AsyncLLM(engine), ServerSettings())) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=body, headers=header) as first:
        next(first.iter_lines())  # in flight
        short = dict(prompt="x", max_tokens=1)
        again = c.post("/v1/completions", json=short, headers=header)
        assert again.status_code == 200, again.text
        assert again.json()["id"] == "cmpl-same"
        alone = c.post("/v1/completions", json=short).json()["choices"][0]["text"]
        assert again.json()["choices"][0]["text"] == alone  # none of the first's tokens


def test_cors_flags_reach_the_settings_and_bad_ones_name_the_flag(capsys):
    from kiln.entrypoints.cli.main import build_parser
    from kiln.entrypoints.cli.serve import settings_from_args

    parser = build_parser()
    s = settings_from_args(parser.parse_args(["serve"]))
    assert s.allowed_origins == ["*"] and not s.allow_credentials
    s = settings_from_args(parser.parse_args(["serve", "--allowed-origins", '["https://a.b"]',
                                              "--allow-credentials"]))
    assert s.allowed_origins == ["https://a.b"] and s.allow_credentials
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--allowed-origins", "https://a.b"])
    assert "--allowed-origins takes a JSON list of strings" in capsys.readouterr().err
