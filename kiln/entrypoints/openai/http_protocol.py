"""uvicorn's HTTP protocol with a deadline and a size cap for request headers, and a deadline for
a reply the client stops reading. uvicorn waits for headers forever, so a client that connects
and sends nothing (or half a header line) would hold a socket for good; its httptools path
buffers them without limit (a header value grows by copying, so megabytes of one keep the event
loop busy and the process's memory growing); and a stream whose client reads nothing waited on
the full socket for good, its request running on and its output queueing in the server.

On httptools (C) where it is installed, else h11 (pure Python, several times the CPU per
connection: a flood of connections then starves the event loop that streams tokens). Between
requests of a kept-alive connection uvicorn's own keep-alive timeout applies.
"""

import fcntl
import json
import struct
import termios

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


def unsent_bytes(transport) -> int:
    """What `transport` holds that its client has not taken: its own buffer, and on Linux the
    socket's kernel send queue, which holds megabytes a reading client drains long before the
    transport's buffer moves."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (AttributeError, OSError):
        return size
    return size + struct.unpack("i", queued)[0]


def base_protocol() -> type:
    """uvicorn's httptools protocol where httptools imports, else its h11 one."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def hardened_protocol(header_timeout_s: float, send_timeout_s: float = 60.0,
                      base: type | None = None) -> type:
    """A protocol class (over `base`, default base_protocol()) that closes a connection whose
    request headers are not complete `header_timeout_s` seconds after it opened or after the
    first bytes of a request came, answers 431 (and closes) once they pass MAX_HEADER_BYTES,
    and drops one whose client has read nothing of a full send buffer for `send_timeout_s`
    (nginx's send_timeout, between two reads): the app then sees a disconnect, which aborts
    the request. A read shows only as the peer's TCP window reopens (about a segment freed), so
    a client reading less than that per timeout counts as reading nothing."""

    class HardenedProtocol(base or base_protocol()):
        _send_deadline = None

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
            self._disarm_send_deadline()
            super().connection_lost(exc)

        # The transport calls these as its send buffer passes its high and low water marks.
        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm_send_deadline()

        def _arm_send_deadline(self) -> None:
            self._disarm_send_deadline()
            self._unsent = unsent_bytes(self.transport)
            self._send_deadline = self.loop.call_later(send_timeout_s, self._send_deadline_passed)

        def resume_writing(self) -> None:
            self._disarm_send_deadline()
            super().resume_writing()

        def _disarm_send_deadline(self) -> None:
            if self._send_deadline is not None:
                self._send_deadline.cancel()
                self._send_deadline = None

        def _send_deadline_passed(self) -> None:
            self._send_deadline = None
            if unsent_bytes(self.transport) < self._unsent:
                self._arm_send_deadline()  # the client read some: a slow reader, not a dead one
            else:  # abort, not close: close would wait for the unread buffer to drain
                self.transport.abort()

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(header_timeout_s,
                                                         self._header_deadline_passed)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_deadline_passed(self) -> None:
            self._header_deadline = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

    return HardenedProtocol
