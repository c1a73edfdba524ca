"""A deadline on each request's head, so slow-loris clients cannot hold connections for ever.

uvicorn times out a kept-alive connection only while it is silent, and never a client that sends
its request line and headers a byte at a time: each byte restarts nothing and the connection stays
open for as long as the client likes. Here every request head has `--header-timeout` seconds,
counted from the connection's start or from the end of the previous response on it. Past it, a
connection that had started a head gets a 408 in OpenAI's error shape and is closed; one that sent
nothing is closed without an answer, as an idle kept-alive connection is (an answer nobody asked
for would be read as the reply to the client's next request). The body's own deadline is
`--body-timeout`, kept by limits.py once the head is in.

uvicorn's h11 protocol (what `http="auto"` picks without httptools), hooked where a connection
opens, receives, completes a response and closes: the deadline is armed whenever the connection
waits for a head and cleared when h11 has parsed one.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockserve.server.http.errors import APIError, error_body


def header_timeout_error(timeout: float) -> APIError:
    return APIError(408, f"the request's line and headers did not arrive within {timeout:g} s (--header-timeout); "
                         f"the connection was closed", code="header_timeout")


def protocol_with_header_timeout(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class with a `timeout`-second deadline on each request head (pass it
    as uvicorn.Config's `http`)."""
    body = json.dumps(error_body(header_timeout_error(timeout))).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._follow_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._clear_deadline()
            super().connection_lost(exc)

        def _follow_head(self) -> None:
            """Arm the deadline while h11 waits for a request head; clear it once one is parsed."""
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if waiting and self._head_deadline is None:
                self._head_deadline = self.loop.call_later(timeout, self._head_timed_out)
            elif not waiting:
                self._clear_deadline()

        def _clear_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:  # part of a head came: h11 holds it, unparsed
                self.transport.write(answer)
            self.transport.close()

    return HeaderDeadlineProtocol
