"""Server hardening on a fake engine: the key on every route, 404 for an unknown model, text the
tokenizer cannot take, the prompts x n cap, served names, header / body read timeouts, and a
client that stops reading."""
import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.http_protocol import hardened_protocol
from kiln.model.loader import default_model

from .fake_engine import FakeEngine
from .test_api_fake_engine import assert_error
from .uvicorn_thread import uvicorn_in_thread

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


@pytest.fixture()
def live_server():
    """The fake-engine app on uvicorn with 0.5 s header and body timeouts."""
    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(request_body_timeout=0.5))
    with uvicorn_in_thread(app, http=hardened_protocol(0.5)) as port:
        yield port


def _post_headers(content_length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(content_length).encode() + b"\r\n\r\n")


def _read_all(sock: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything until the server closes (b"" at once: it closed); fails on our timeout."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_complete_headers_is_closed(live_server, sent):
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(sent)
        assert _read_all(sock) == b""  # closed by the server, no response: no request came


def test_a_stalled_body_gets_408_and_the_connection_closes(live_server):
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(_post_headers(100) + b'{"prompt": ')
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--request-body-timeout" in reply


def test_a_complete_request_is_answered_on_the_same_server(live_server):
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("flood", [b"X-Big: " + b"a" * 100_000, b"X-h: v\r\n" * 12_000])
def test_oversized_headers_get_431_and_the_connection_closes(live_server, flood):
    """Unbounded, httptools copied a growing header value on every read and kept every line:
    one client stalled the event loop and grew the process by gigabytes."""
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            sock.sendall(flood)
        except OSError:  # the server may close while we still send
            pass
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"request_header_fields_too_large"' in reply and b"connection: close" in reply


def test_a_trickled_body_gets_408(live_server):
    """Each byte comes within the 0.5 s gap allowed, but far slower than the minimum rate."""
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(_post_headers(100))
        sock.settimeout(0.3)
        reply = b""
        for _ in range(20):  # 6 s at most
            try:
                sock.sendall(b" ")
                reply += sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if reply:
                break
        reply += _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"bytes/s" in reply and b"--request-body-timeout" in reply


def test_a_413_closes_the_connection_instead_of_reading_the_rest(live_server):
    with socket.create_connection(("127.0.0.1", live_server)) as sock:
        sock.sendall(_post_headers(20_000_000_000) + b"{")
        reply = _read_all(sock)  # fails if the server kept the connection open
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply


def test_a_413_reaches_a_client_that_sends_its_whole_body_first():
    """urllib writes the whole body before it reads: the 413 sent (and the connection closed)
    while 32 MB were still coming was a broken pipe or reset (helper-90). Read to its end now; a
    client that waits for 100 Continue gets the 413 without sending its body."""
    import json
    import urllib.error
    import urllib.request

    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(max_request_body_bytes=2000))
    with uvicorn_in_thread(app, http=hardened_protocol(5)) as port:
        body = json.dumps({"prompt": "x" * 32_000_000}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 413
        assert b"--max-request-body-bytes" in refused.value.read()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(_post_headers(len(body))[:-2] + b"Expect: 100-continue\r\n\r\n")
            assert _read_all(sock).startswith(b"HTTP/1.1 413")


def test_a_401_reaches_a_client_that_sends_its_whole_body_first():
    """As the 413: a wrong key's answer was sent (and the connection closed) while a 32 MB body
    was still coming, and urllib got a broken pipe instead of the 401. Its body is dropped
    now; a client that waits for 100 Continue gets the 401 without sending it."""
    import json
    import urllib.error
    import urllib.request

    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY,
                                                           max_request_body_bytes=64_000_000))
    with uvicorn_in_thread(app, http=hardened_protocol(5)) as port:
        body = json.dumps({"prompt": "x" * 32_000_000}).encode()
        for auth in ({"Authorization": "Bearer wrong"}, {}):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                             data=body, headers={
                                                 "content-type": "application/json", **auth})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401
            assert b"API key" in refused.value.read()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(_post_headers(len(body))[:-2] + b"Expect: 100-continue\r\n\r\n")
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 401")


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


def test_an_early_answer_leaves_its_unread_body_out_of_the_header_count():
    """A 401 answered before a 300 KB body was read: the rest of the body, parsed after the
    response, was counted as the next request's headers, and a stray 431 followed (helper-44)."""
    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(api_key=KEY))
    with uvicorn_in_thread(app, http=hardened_protocol(5)) as port, \
            socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_post_headers(300_000) + b" " * 300_000
                     + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 401") and b" 431 " not in reply, reply[:400]
    assert reply.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200" in reply, reply[-400:]


def _endless_stream_app(disconnected: threading.Event):
    """An ASGI app that streams 64 KiB chunks until the client is gone."""
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not disconnected.is_set():
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        watcher.cancel()
    return app


@pytest.mark.parametrize("reads", [False, True])
def test_a_client_that_reads_nothing_of_a_full_buffer_is_dropped(reads):
    """A stream whose client read nothing waited on the full socket for good (its request ran
    on, its output queued in the server); one that reads, however slowly, is kept."""
    disconnected = threading.Event()
    with uvicorn_in_thread(_endless_stream_app(disconnected),
                           http=hardened_protocol(5, send_timeout_s=0.5)) as port, \
            socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 3
        while reads and time.monotonic() < deadline:
            sock.recv(65536)
            time.sleep(0.02)
        assert disconnected.wait(0 if reads else 10) != reads


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
