"""uvicorn with a drain: the first SIGTERM / SIGINT runs the caller's drain before uvicorn's own
shutdown (which closes the port), and no signal is re-raised at exit; a second one exits at once.
The connections are uvicorn's h11 protocol with the server's head deadline (header_deadline.py)
and connection cap (connection_cap.py): `uvicorn_config`."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from blockserve.server.config import ServerConfig

CONNECTIONS_GRACE_S = 5  # after the drain: how long uvicorn waits for connections to close
KEEP_ALIVE_S = 5  # how long an idle kept-alive connection stays open (uvicorn's default, stated)


def serve_with_drain(app, config: ServerConfig, drain: Callable[[str], Awaitable[None]]) -> bool:
    """Serve `app` on config.host:config.port until a signal, then `await drain(signal name)` and
    exit. True if it ended that way; False if a second signal cut the drain short."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            self._drain: asyncio.Task | None = None
            self._signalled = False
            await super().serve(sockets)

        def handle_exit(self, sig, frame) -> None:  # a signal handler: only hand over to the loop
            if self._signalled:
                self.should_exit = self.force_exit = True
                return
            self._signalled = True
            self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

        def _start_drain(self, name: str) -> None:
            self._drain = self._loop.create_task(self._drain_then_exit(name))

        async def _drain_then_exit(self, name: str) -> None:
            try:
                await drain(name)
            finally:
                self.should_exit = True

    server = DrainingServer(uvicorn_config(app, config))
    server.run()
    return not server.force_exit


def uvicorn_config(app, config: ServerConfig):
    """uvicorn's settings for serving `app` as `config` says: its address, and each connection's
    head deadline (--header-timeout) and the cap on open connections (--max-connections)."""
    import uvicorn

    from blockserve.server.http.connection_cap import protocol_with_connection_cap
    from blockserve.server.http.header_deadline import protocol_with_header_timeout

    protocol = protocol_with_connection_cap(protocol_with_header_timeout(config.header_timeout),
                                            config.max_connections)
    # uvicorn's own logs (start-up, access lines) stay at warnings; ours follow the CLI's -q.
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          timeout_graceful_shutdown=CONNECTIONS_GRACE_S, timeout_keep_alive=KEEP_ALIVE_S,
                          http=protocol)
