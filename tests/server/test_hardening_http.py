"""Server hardening at the HTTP level, on a fake engine behind uvicorn: header and body read
timeouts, oversized headers, early 413 / 401 answers, and a client that stops reading."""
import asyncio
import json
import socket
import threading
import time

import pytest

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.http_protocol import hardened_protocol

from .fake_engine import FakeEngine
from .test_hardening import KEY
from .uvicorn_thread import uvicorn_in_thread


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
