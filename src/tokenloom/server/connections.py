"""Connection hygiene below the app: a request's headers arrive within a deadline, within limits, unambiguous.

uvicorn closes a keep-alive connection that stays idle after a response, but not one that never sends a request,
nor one that sends its headers a byte at a time (slowloris): either would hold a socket forever. This protocol
closes a connection whose request headers are not complete within ``header_timeout`` seconds of it opening or of
its last response.

It also reads each request's header block before h11 parses it: over ``max_header_bytes`` or ``max_header_count``
is a 431, and a request that gives both Content-Length and Transfer-Encoding is a 400 (RFC 9112 6.1: a proxy in
front may frame the body one way and this server the other, request smuggling). Either refusal is answered with
an OpenAI-style error body and ``Connection: close``, and the connection keeps draining what the client still
sends for a moment before it closes, so that a client in the middle of sending 1 MB of headers reads the answer
instead of a reset.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenloom.server.errors import APIError

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADER_COUNT = 100
LINGER_S = 2.0  # how long a refused connection drains the client's bytes before it closes


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    max_header_count: int = MAX_HEADER_COUNT
    _refused: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # draining until the client has read the refusal, or the linger ends
        super().data_received(data)

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE:  # the next request's headers, before h11 reads them
            refusal = self._refusal(self.conn.trailing_data[0])
            if refusal is not None:
                self._refuse(refusal)
                return
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in: the deadline has been met
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _refusal(self, buffered: bytes | bytearray) -> APIError | None:
        """Why the request whose bytes begin `buffered` is refused before it is parsed, if it is."""
        end = buffered.find(b"\r\n\r\n")
        block = bytes(buffered if end < 0 else buffered[: end + 4])
        if len(block) > self.max_header_bytes:
            message = f"the request line and headers are over {self.max_header_bytes} bytes"
            return APIError(431, message, None, "request_header_fields_too_large")
        if end < 0:
            return None  # incomplete, and still within the limit
        lines = block.split(b"\r\n")[1:-2]  # after the request line, before the blank line
        if len(lines) > self.max_header_count:
            message = f"{len(lines)} header fields, over the limit of {self.max_header_count}"
            return APIError(431, message, None, "request_header_fields_too_large")
        names = {line.split(b":", 1)[0].strip().lower() for line in lines}
        if b"content-length" in names and b"transfer-encoding" in names:
            message = "a request may not give both Content-Length and Transfer-Encoding"
            return APIError(400, message, None, "ambiguous_framing")
        return None

    def _refuse(self, error: APIError) -> None:
        self._refused = True
        self._disarm_header_deadline()
        body = json.dumps(error.body()).encode()
        reason = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}.get(error.status, b"Error")
        head = [
            b"HTTP/1.1 %d %s" % (error.status, reason),
            b"content-type: application/json",
            b"content-length: %d" % len(body),
            b"connection: close",
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def eof_received(self) -> None:
        if self._refused:
            self._close()  # the client has sent all it will and has the answer
            return
        super().eof_received()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._close_if_no_headers)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _close_if_no_headers(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_limits(
    timeout: float, max_bytes: int = MAX_HEADER_BYTES, max_count: int = MAX_HEADER_COUNT
) -> type[HeaderDeadlineProtocol]:
    """The protocol class to give uvicorn (``http=``), with its deadline and limits set."""
    limits = {"header_timeout": timeout, "max_header_bytes": max_bytes, "max_header_count": max_count}
    return type("HeaderLimits", (HeaderDeadlineProtocol,), limits)
