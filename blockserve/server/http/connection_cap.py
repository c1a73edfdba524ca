"""A cap on open connections (--max-connections), so clients cannot hold sockets without bound.

Every open connection counts, idle kept-alive ones included: each holds a socket and a file
descriptor however little it sends. A connection opened while the server holds the cap is served
no request: its first request gets 503 `too_many_connections` in OpenAI's shape, with
Retry-After, and the connection is closed. It is answered once its request head arrives (an
answer sent earlier would be read as the reply to whatever the client sends next, and closing at
once would reset the request the client is sending), within --header-timeout like any other.
uvicorn's own `limit_concurrency` answers in plain text and counts running requests as well.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from blockserve.server.http.errors import TooManyConnections, error_response


def protocol_with_connection_cap(protocol: type[H11Protocol], max_connections: int) -> type[H11Protocol]:
    """`protocol` (uvicorn's h11 protocol or a subclass) refusing every connection past
    `max_connections` open ones as described above."""
    refusal = error_response(TooManyConnections(max_connections), close=True)  # an ASGI app

    class ConnectionCapProtocol(protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)  # counted among the server's connections from here on
            if len(self.connections) > max_connections:
                self.app = refusal

    return ConnectionCapProtocol
