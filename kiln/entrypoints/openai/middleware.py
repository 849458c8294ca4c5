"""Pure ASGI middleware: bearer-key auth on every route but the open ones, a request body size
limit (HTTP 413) and a body read timeout (HTTP 408).

Pure ASGI (not BaseHTTPMiddleware) so streamed responses and disconnect detection pass through.
"""
import asyncio
import hmac
import json

from kiln.entrypoints.openai.errors import error_body


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on every path but `open_paths` (/health:
    load balancers probe it without a key)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or \
                scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
               else "incorrect API key")
        await _send_json(send, 401, error_body(msg, 401, code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


class BodySizeLimitMiddleware:
    """Reads the whole body first (refusing past `max_bytes`, or a client that sends nothing for
    `read_timeout` s: a half-open connection must not hold a handler forever), then replays it
    to the app."""

    def __init__(self, app, max_bytes: int, read_timeout: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    def _too_large(self) -> dict:
        return error_body(f"request body exceeds {self.max_bytes} bytes; send less or raise "
                          "--max-request-body-bytes", 413, code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_json(send, 413, self._too_large())
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except TimeoutError:
                body = error_body(f"no request body data for {self.read_timeout:g} s; send the "
                                  "whole body promptly (--request-body-timeout)", 408,
                                  code="request_timeout")
                return await _send_json(send, 408, body, [(b"connection", b"close")])
            if message["type"] != "http.request":  # client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_json(send, 413, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: wait for http.disconnect

        return await self.app(scope, replay, send)
