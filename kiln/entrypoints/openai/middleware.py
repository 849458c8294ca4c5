"""Pure ASGI middleware: bearer-key auth on every route but the open ones, a request body size
limit (HTTP 413), body read deadlines (HTTP 408), the client's X-Request-Id echoed back and the
count of generation requests in flight (GET /load).

Pure ASGI (not BaseHTTPMiddleware) so streamed responses and disconnect detection pass through.
"""
import asyncio
import hmac
import json
import time
import uuid

from kiln.entrypoints.openai.errors import error_body


def get_route_path(scope) -> str:
    """The path the routes see: under --root-path (FastAPI's root_path), a request may come
    with the prefix (a proxy that keeps it) or without; the prefix is not part of the route."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


async def _drop_body(scope, receive, max_bytes: int, timeout: float | None) -> None:
    """Read a refused request's body to its end and drop it, for up to `max_bytes` and
    `timeout` s: a client that writes its whole body before it reads (Python's urllib) got a
    broken pipe (the close with unread data) instead of the answer. Past either, or where the
    client waits for 100 Continue (it has sent nothing), the answer comes at once."""
    headers = dict(scope["headers"])
    if scope["method"] in ("GET", "HEAD", "OPTIONS") or \
            headers.get(b"expect", b"").lower() == b"100-continue":
        return

    async def drain():
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False) or \
                    size > max_bytes:
                return
    try:
        await asyncio.wait_for(drain(), timeout)
    except TimeoutError:
        pass


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on every path but `open_paths` (/health:
    load balancers probe it without a key). The scheme's case does not matter (RFC 7235). A
    refused body is dropped (`body_bytes`, `body_timeout`: --max-request-body-bytes and
    --request-body-timeout), never kept."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",),
                 body_bytes: int = 4 * 1024 * 1024, body_timeout: float | None = 30.0):
        self.app = app
        # The key's bytes as given: ones that are not UTF-8 ($KILN_API_KEY, --api-key) reach
        # Python as lone surrogates, which a plain encode() refused as the server started.
        self.expected = api_key.encode("utf-8", "surrogateescape")
        self.open_paths = frozenset(open_paths)
        self.body_bytes, self.body_timeout = body_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or \
                get_route_path(scope) in self.open_paths:  # under --root-path too
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:  # which one counts would differ between proxies: refuse both
            await _drop_body(scope, receive, self.body_bytes, self.body_timeout)
            return await _send_json(send, 400, error_body(
                f"{len(given)} Authorization headers; send exactly one", 400,
                code="invalid_api_key"))
        scheme, _, key = (given[0] if given else b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected):
            return await self.app(scope, receive, send)
        msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
               else "incorrect API key")
        await _drop_body(scope, receive, self.body_bytes, self.body_timeout)
        await _send_json(send, 401, error_body(msg, 401, code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


class RequestIdHeaderMiddleware:
    """The client's X-Request-Id back on its response, as OpenAI's API and vLLM's
    --enable-request-id-headers answer (the OpenAI SDK reads it as the response's request id);
    the completion routes also take it as the response's id (request_fields.response_id).
    `always` (--enable-request-id-headers): a request without one gets a new id, as vLLM's."""

    def __init__(self, app, always: bool = False):
        self.app = app
        self.always = always

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if given is None and self.always:
            given = uuid.uuid4().hex.encode()
        if given is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", given)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


class ServerLoadMiddleware:
    """Counts the generation requests in flight for GET /load (vLLM's server_load): each POST
    to a completion route from its start until its response's last byte is sent or the client
    left, whatever the outcome."""

    PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses"))

    class Counter:
        value = 0

    def __init__(self, app, counter: "ServerLoadMiddleware.Counter"):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or \
                get_route_path(scope) not in self.PATHS:
            return await self.app(scope, receive, send)
        self.counter.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.value -= 1


# A body must also arrive at this average rate (after the first read_timeout s), as Apache's
# mod_reqtimeout asks: a client trickling a byte now and then would otherwise hold a handler and
# a socket for as long as it likes.
MIN_BODY_BYTES_PER_S = 500
_CLOSE = [(b"connection", b"close")]  # the unread rest of the body is not read, nor waited for
# A body this far past --max-request-body-bytes is still read (and dropped) before the 413: a
# client that writes its whole body before it reads (Python's urllib) otherwise gets a connection
# reset (the close with unread data) instead of the answer. Past it, the 413 comes at once.
DRAIN_BYTES = 64 * 1024 * 1024


class ShutdownGate:
    """Closed by the server once its shutdown grace period is over: a body still being read
    then gets a 503 at once (the engine's abort never reaches a handler that is not in it)."""

    def __init__(self):
        self.reason: str | None = None
        self._event: asyncio.Event | None = None

    def close(self, reason: str) -> None:
        self.reason = reason
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
            if self.reason is not None:
                self._event.set()
        await self._event.wait()


class BodySizeLimitMiddleware:
    """Reads the whole body first (refusing past `max_bytes`, or a client that sends nothing for
    `read_timeout` s or sends slower than MIN_BODY_BYTES_PER_S: a half-open connection must not
    hold a handler forever), then replays it to the app."""

    def __init__(self, app, max_bytes: int, read_timeout: float | None = None,
                 gate: ShutdownGate | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.gate = gate or ShutdownGate()

    def _too_large(self) -> dict:
        return error_body(f"request body exceeds {self.max_bytes} bytes; send less or raise "
                          "--max-request-body-bytes", 413, code="request_too_large")

    def _timed_out(self, size: int) -> dict:
        return error_body(f"the request body did not arrive in time (after {size} bytes: no "
                          f"data for {self.read_timeout:g} s, or slower than "
                          f"{MIN_BODY_BYTES_PER_S} bytes/s); send the whole body promptly "
                          "(--request-body-timeout)", 408, code="request_timeout")

    async def _read_body(self, receive, send, closing: asyncio.Future) -> list[bytes] | None:
        """The body's chunks; None where it answered instead or the client left."""
        chunks, size = [], 0
        start = time.monotonic()
        while True:
            timeout = self.read_timeout
            if timeout is not None:
                deadline = start + timeout + size / MIN_BODY_BYTES_PER_S
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            read = asyncio.ensure_future(receive())
            try:
                await asyncio.wait({read, closing}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not read.done():
                    read.cancel()
            if not read.done() or read.cancelled():
                if self.gate.reason is not None:
                    await _send_json(send, 503, error_body(
                        self.gate.reason, 503, code="server_shutting_down"), _CLOSE)
                elif size > self.max_bytes:  # too slow to drain: too large all the same
                    await _send_json(send, 413, self._too_large(), _CLOSE)
                else:
                    await _send_json(send, 408, self._timed_out(size), _CLOSE)
                return None
            message = read.result()
            if message["type"] != "http.request":  # client left before sending it all
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:  # dropped, and read on to its end (DRAIN_BYTES)
                if not more or size > self.max_bytes + DRAIN_BYTES:
                    await _send_json(send, 413, self._too_large(), _CLOSE)
                    return None
                chunks = []
                continue
            chunks.append(chunk)
            if not more:
                return chunks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes and (
                int(length) > self.max_bytes + DRAIN_BYTES
                or headers.get(b"expect", b"").lower() == b"100-continue"):  # nothing sent yet
            return await _send_json(send, 413, self._too_large(), _CLOSE)
        closing = asyncio.ensure_future(self.gate.wait())  # one watch for the whole body
        try:
            chunks = await self._read_body(receive, send, closing)
        finally:
            closing.cancel()
        if chunks is None:  # answered (408, 413, 503), or the client left
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: wait for http.disconnect

        return await self.app(scope, replay, send)
