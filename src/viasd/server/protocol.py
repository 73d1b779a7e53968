"""The HTTP/1.1 connection `viasd serve` runs under uvicorn: uvicorn's h11 protocol with the limits it
lacks on a request's head (request line and headers), each refusal an OpenAI-style error body:

- a head over MAX_HEAD bytes: 431 (uvicorn's httptools accepts any size; its h11 answers a plain 400);
- a head not complete `header_timeout` seconds after the connection opened or its last response ended
  (slowloris: a client that keeps many connections open by trickling header bytes): 408, or a silent
  close when not a byte came, as an idle keep-alive connection gets;
- a Content-Length of more digits than h11 reads: 413, as a large one gets from the app (AuthAndSize);
  any other malformed head: 400 naming h11's complaint.

The app never sees these requests: they end in the protocol, before a scope exists."""

from __future__ import annotations

import json
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from viasd.server.errors import error_body

MAX_HEAD = 64 * 1024  # bytes of a request line and headers
HEADER_TIMEOUT = 20.0  # seconds a request's head may take to arrive
LINGER = 2.0  # seconds of a refused client's further bytes dropped before the close (bytes unread: a reset, the answer lost)
_CONTENT_LENGTH = re.compile(rb"(?im)^content-length[ \t]*:[ \t]*[0-9]+[ \t]*\r?$")
_HEAD_END = re.compile(rb"\n\r?\n")  # (h11 takes a bare \n as a line's end too)


class _Connection(h11.Connection):
    """h11's server connection, keeping the error that broke it (uvicorn's protocol keeps only a 400)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with a size and a time limit on each request's head (`protocol` sets the time)."""

    header_timeout: float = HEADER_TIMEOUT
    conn: _Connection

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.head = bytearray()  # the bytes of the head being read (up to MAX_HEAD + 1), for its size and error
        self.head_read = False  # its end seen (h11 takes a head of any size that arrives whole)
        self.head_timer = None
        self.refused = False  # answered by _refuse: what still comes is dropped

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.conn.their_state is h11.IDLE and not self.head_read:
            start = max(0, len(self.head) - 2)  # (a blank line split between two reads)
            self.head += data[:MAX_HEAD + 1 - len(self.head)]
            if _HEAD_END.search(self.head, start):
                self.head_read = True
            elif len(self.head) > MAX_HEAD:
                self._refuse(431, f"the request line and headers are over the {MAX_HEAD}-byte limit", "request_header_too_large")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is read (or broken): the app's time now
            self._disarm()
            self.head.clear()
            self.head_read = False

    def shutdown(self) -> None:
        if self.refused:
            self.transport.close()
        else:
            super().shutdown()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # waiting for the next request's head
            self._arm()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refused: the status h11 suggests, in OpenAI's shape."""
        e = self.conn.error
        if e is not None and e.error_status_hint == 431:
            self._refuse(431, f"the request line and headers are over the {MAX_HEAD}-byte limit", "request_header_too_large")
        elif e is not None and "Content-Length" in str(e) and _CONTENT_LENGTH.search(bytes(self.head)):
            self._refuse(413, "the request's Content-Length is over the body size limit", "request_too_large")
        else:
            self._refuse(400, f"malformed HTTP request: {e or msg}", "invalid_request")

    def _arm(self) -> None:
        self._disarm()
        self.head.clear()
        self.head_read = False
        self.head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.head:
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout:g} s", "request_timeout")
        else:  # not a byte of a request: closed as an idle keep-alive connection is
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """An error response written as it is (h11 has no request to answer), then the connection closed
        once LINGER s of what the client still sends are dropped."""
        body = json.dumps(error_body(message, code=code)).encode()
        reason = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
                  431: "Request Header Fields Too Large"}[status]
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                             "connection: close\r\n\r\n".encode() + body)
        self.refused = True
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)


def protocol(header_timeout: float = HEADER_TIMEOUT) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), heads timed out after `header_timeout` s."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})
