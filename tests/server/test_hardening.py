"""Server hardening on a fake engine: the key on every route, 404 for an unknown model, text the
tokenizer cannot take, the prompts x n cap, served names, unreadable bodies. Read timeouts and
slow clients: test_hardening_http.py; CORS and request ids: test_cors_and_request_ids.py."""
import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.model.loader import default_model

from .fake_api import assert_error
from .fake_engine import FakeEngine

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODIES = {"/v1/completions": dict(prompt="x", max_tokens=1),
          "/v1/chat/completions": dict(messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1),
          "/v1/responses": dict(input="x", max_output_tokens=1),
          "/tokenize": dict(prompt="x"), "/detokenize": dict(tokens=[5]),
          "/v1/embeddings": dict(input="x"), "/pooling": dict(input="x"),
          "/classify": dict(input="x"), "/score": dict(text_1="x", text_2="y"),
          "/v1/score": dict(text_1="x", text_2="y"),
          **{p: dict(query="x", documents=["y"]) for p in ("/rerank", "/v1/rerank",
                                                            "/v2/rerank")}}
# Past the key, routes of the other runner and of the response store (off here) answer their
# refusal, naming the flag or variable that serves them.
STORE = "KILN_ENABLE_RESPONSES_API_STORE"
POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                  "/v1/rerank", "/v2/rerank")
REFUSED = {**{p: (400, "--runner pooling") for p in POOLING_ROUTES},
           "/v1/responses/{response_id}": (404, STORE),
           "/v1/responses/{response_id}/cancel": (404, STORE)}


def app_routes(app) -> list[tuple[str, str]]:
    return [(method, route.path) for route in app.routes
            for method in sorted(getattr(route, "methods", None) or ()) if method != "HEAD"]


@pytest.mark.parametrize("metrics_public", [False, True])
def test_every_route_but_health_needs_the_key(metrics_public):
    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY,
                                                           metrics_public=metrics_public))
    open_paths = {"/health", "/ping"} | ({"/metrics"} if metrics_public else set())
    routes = app_routes(app)
    assert {path for _, path in routes} >= {"/tokenize", "/detokenize", "/openapi.json",
                                            "/metrics", "/version", "/v1/models",
                                            *POOLING_ROUTES}
    with TestClient(app) as c:
        for method, path in routes:
            r = c.request(method, path, json=BODIES.get(path))
            if path in open_paths:
                assert r.status_code == 200, (path, r.text)
            else:
                assert_error(r, 401, None, "invalid_api_key")
                ok = c.request(method, path, json=BODIES.get(path), headers=AUTH)
                if path in REFUSED:
                    status, names = REFUSED[path]
                    assert ok.status_code == status and names in ok.text, (path, ok.text)
                    continue
                assert ok.status_code == 200, (path, ok.text)


def test_an_api_key_that_is_not_utf8_is_its_bytes():
    """Bytes that are not UTF-8 in $KILN_API_KEY reach Python as lone surrogates: the server
    failed to start, after loading the model, with a bare UnicodeEncodeError. (Raw ASGI: the
    test client re-encodes header bytes.)"""
    from kiln.entrypoints.openai.middleware import ApiKeyMiddleware

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    guard = ApiKeyMiddleware(app, "k\udcff")
    scope = {"type": "http", "method": "GET", "path": "/v1/models",
             "headers": [(b"authorization", b"Bearer k\xff")]}
    asyncio.run(guard(scope, None, None))
    assert reached == ["/v1/models"]


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    with TestClient(build_app(llm, ServerSettings(max_sequences_per_request=4))) as c:
        yield c


@pytest.mark.parametrize("path", [p for p in BODIES if p not in REFUSED])
def test_an_unknown_model_is_a_404(client, path):
    err = assert_error(client.post(path, json=dict(BODIES[path], model="gpt-17")), 404,
                       "model", "model_not_found")
    assert "gpt-17" in err["message"] and "fake-model" in err["message"]


# Completions prompts: the real engine's input processor (test_core_process_server.py).
@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud83d"}]}',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param)
    assert "surrogate" in err["message"]


TOOL = {"type": "function", "function": {"name": "f\ud800"}}


# Every string of a body, as the first bad one's path: the model's name in a 404 and a named tool
# in the answer failed to render (500s, the second after the whole generation), a stop string or
# request_id failed on its way to the core (a 400 naming the prompt), a bad word in the tokenizer.
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", dict(prompt="x", model="m\ud800"), "model"),
    ("/detokenize", dict(tokens=[5], model="\udc00"), "model"),
    ("/v1/completions", dict(prompt="x", stop=["ok", "\ud800"]), "stop[1]"),
    ("/v1/completions", dict(prompt="x", request_id="\ud800"), "request_id"),
    ("/v1/completions", dict(prompt="x", bad_words=["\ud800"]), "bad_words[0]"),
    ("/v1/completions", dict(prompt="x", logit_bias={"\ud800": 1}), "logit_bias"),
    ("/v1/completions", {"prompt": "x", "\ud800": 1}, None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x", "name": "\ud800"}]),
     "messages[0].name"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                  tool_choice={"type": "function", "function": {"name": "f\ud800"}}),
     "tools[0].function.name"),
])
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_it(client, path, body, param):
    raw = json.dumps(body)  # "\\ud800" escapes, as JSON carries them
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param, "invalid_value")
    assert "surrogate" in err["message"]


def test_a_body_jiter_refuses_for_another_reason_is_read_as_before(client):
    """UTF-16 (json.loads reads it, jiter does not) without a surrogate is served."""
    body = json.dumps(dict(prompt="x é", max_tokens=1)).encode("utf-16")
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_prompts_times_n_is_capped(client):
    err = assert_error(client.post("/v1/completions", json=dict(prompt=["a", "b", "c"], n=2)),
                       400, "n", "too_many_sequences")
    assert "--max-sequences-per-request" in err["message"] and "6" in err["message"]
    assert_error(client.post("/v1/completions", json=dict(prompt=["a"] * 5)), 400, "prompt",
                 "too_many_sequences")
    assert_error(client.post("/v1/chat/completions", json=dict(
        messages=[{"role": "user", "content": "x"}], n=5)), 400, "n", "too_many_sequences")
    ok = client.post("/v1/completions", json=dict(prompt=["a", "b"], n=2, max_tokens=1))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", dict(prompt="x", n=2)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], n=2))])
def test_bad_words_times_n_is_capped(path, body):
    """Each sample's bad words cross to the engine core and are indexed on its step loop:
    5,000 words at n=64 held every other stream on the server for 7 s."""
    from kiln.sampling_params import MAX_BAD_WORDS_PER_REQUEST

    words = [f"w{i}" for i in range(MAX_BAD_WORDS_PER_REQUEST // 2 + 1)]
    with TestClient(build_app(AsyncLLM(FakeEngine()), ServerSettings())) as c:
        err = assert_error(c.post(path, json=dict(body, bad_words=words)), 400, "bad_words",
                           "invalid_value")
        assert f"{len(words)} x 2 = {len(words) * 2}" in err["message"]
        ok = c.post(path, json=dict(body, bad_words=words[:-1], max_tokens=1))
        assert ok.status_code == 200, ok.text


def test_a_model_folder_whose_name_is_not_utf8_is_served_under_a_displayable_name():
    """Its lone surrogates (bytes that are not UTF-8) made /v1/models and every answer that
    names the model a 500."""
    engine = FakeEngine()
    engine.kiln_config.model_config.model = "/models/caf\udce9"
    with TestClient(build_app(AsyncLLM(engine), ServerSettings())) as c:
        (card,) = c.get("/v1/models").json()["data"]
        assert card["id"] == card["root"] == "/models/caf\ufffd"
        r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=1))
        assert r.status_code == 200 and r.json()["model"] == "/models/caf\ufffd", r.text


def test_models_name_the_model_not_its_cache_path(client, tmp_path, monkeypatch):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == card["root"] == "fake-model"
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    builtin = default_model.default_model_dir() / default_model.GGUF_NAME
    assert default_model.model_display_name(str(builtin)) == default_model.DEFAULT_MODEL_NAME
    assert default_model.model_display_name("my/model") == "my/model"


def test_health_answers_head():
    with TestClient(build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY))) as c:
        assert c.head("/health").status_code == 200


def test_the_auth_scheme_is_case_blind_and_one_header_is_required():
    with TestClient(build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY))) as c:
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"BEARER  {KEY} "}
                     ).status_code == 200
        assert_error(c.get("/v1/models", headers={"Authorization": KEY}), 401, None,
                     "invalid_api_key")
        two = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")]
        err = assert_error(c.get("/v1/models", headers=two), 400, None, "invalid_api_key")
        assert "exactly one" in err["message"]


@pytest.mark.parametrize("body,headers,needle", [
    (b'{"prompt": "\xff", "max_tokens": 1}', {}, "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, {}, "too deeply"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, "digits"),
    (b'{"prompt": "x"}', {"content-type": "application/x-www-form-urlencoded"},
     "Content-Type: application/json"),
])
def test_unreadable_bodies_say_why(client, body, headers, needle):
    """Before, FastAPI answered the first three with "There was an error parsing the body" and
    the last with a pydantic message that never named the Content-Type."""
    r = client.post("/v1/completions", content=body,
                    headers=headers or {"content-type": "application/json"})
    err = assert_error(r, 400, None)
    assert needle in err["message"], err


@pytest.mark.parametrize("flags, env", [(["--api-key", "key "], {}), ([], {"KILN_API_KEY": " "}),
                                        ([], {"VLLM_API_KEY": "\tkey"})])
def test_an_api_key_with_outer_whitespace_is_refused(flags, env, monkeypatch):
    """HTTP strips the header's outer whitespace: such a key made every request a 401."""
    from kiln.entrypoints.cli.main import build_parser
    from kiln.entrypoints.cli.serve import settings_from_args

    for name in ("KILN_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="--api-key, else .*KILN_API_KEY.* whitespace"):
        settings_from_args(build_parser().parse_args(["serve", *flags]))
