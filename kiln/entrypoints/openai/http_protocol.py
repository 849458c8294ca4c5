"""uvicorn's HTTP protocol with a deadline for request headers: uvicorn waits for them forever,
so a client that connects and sends nothing (or half a header line) would hold a socket for good.

On httptools (C) where it is installed, else h11 (pure Python, several times the CPU per
connection: a flood of connections then starves the event loop that streams tokens). Between
requests of a kept-alive connection uvicorn's own keep-alive timeout applies.
"""


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
    bytes of a request came."""

    class HeaderTimeoutProtocol(base or base_protocol()):
        header_timeout_s = timeout_s

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_deadline = None
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers():
                if self._header_deadline is None:  # the first bytes of a new request
                    self._arm_header_deadline()
            else:
                self._disarm_header_deadline()

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
