"""uvicorn's HTTP protocol with a deadline and a size cap for request headers: uvicorn waits for
them forever, so a client that connects and sends nothing (or half a header line) would hold a
socket for good; and its httptools path buffers them without limit (a header value grows by
copying, so megabytes of one keep the event loop busy and the process's memory growing).

On httptools (C) where it is installed, else h11 (pure Python, several times the CPU per
connection: a flood of connections then starves the event loop that streams tokens). Between
requests of a kept-alive connection uvicorn's own keep-alive timeout applies.
"""

import json

from kiln.entrypoints.openai.errors import error_body

# What a request's headers may take before the reply is 431 (h11's own cap is 16 KiB; proxies
# commonly allow 8-32 KiB). Counted per read, so a read can pass it by up to its own size.
MAX_HEADER_BYTES = 64 * 1024


def _too_large_reply() -> bytes:
    body = json.dumps(error_body(
        f"request headers exceed {MAX_HEADER_BYTES} bytes; send fewer or shorter headers",
        431, code="request_header_fields_too_large")).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body)


def base_protocol() -> type:
    """uvicorn's httptools protocol where httptools imports, else its h11 one."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def header_timeout_protocol(timeout_s: float, base: type | None = None) -> type:
    """A protocol class (over `base`, default base_protocol()) that closes a connection whose
    request headers are not complete `timeout_s` seconds after it opened or after the first
    bytes of a request came, and answers 431 (and closes) once they pass MAX_HEADER_BYTES."""

    class HeaderTimeoutProtocol(base or base_protocol()):
        header_timeout_s = timeout_s

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_deadline = None
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return  # refused below: what is still in flight is not parsed
            super().data_received(data)
            if self._in_headers:
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self._disarm_header_deadline()
                    self.transport.write(_too_large_reply())
                    self.transport.close()
                    return
            if self._awaiting_headers():
                if self._header_deadline is None:  # the first bytes of a new request
                    self._arm_header_deadline()
            else:
                self._disarm_header_deadline()

        # httptools' parser calls these (h11 caps headers itself, at 16 KiB): only bytes that
        # came while a request's headers were open count, not the unread rest of a body that
        # follows an early answer (a 401) on a kept-alive connection.
        _in_headers = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s,
                                                         self._header_deadline_passed)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_deadline_passed(self) -> None:
            self._header_deadline = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
