"""The app in this process, the in-process server tests' one way to serve it: `serve_app` runs a
fresh app over a loaded model, its lifespan (the engine thread) around the test's coroutine, which
calls it with `asgi_request` (no server, no socket); `LoopbackServer` puts the app behind uvicorn
on a loopback port, for a client that needs a socket. A real `blockserve serve` process:
tests/server_process.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from tests.server_process import free_port


async def asgi_request(app, method: str, path: str, body=None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers lower-cased, raw body) of `method path` with `body` (bytes, JSON-able, or None)."""
    payload = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    incoming = [{"type": "http.request", "body": payload}]
    sent = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # the client never goes away

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def sse_events(raw: bytes) -> list:
    """A streamed body's events, each JSON-decoded, "[DONE]" kept as it is."""
    events = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def serve_app(loaded, engine_args: dict, body, config=None):
    """`await body(app, engine)` on a fresh app (`config`: its ServerConfig, None the defaults) over
    an LLMEngine of the loaded model and `engine_args`, with the app's lifespan (the engine thread)
    around it: its result."""
    from blockserve.engine.config import EngineConfig
    from blockserve.engine.core import EngineCore
    from blockserve.engine.llm_engine import LLMEngine
    from blockserve.server.app import create_app

    async def main():
        engine_config = EngineConfig(model=loaded.source, **engine_args)
        engine = LLMEngine(engine_config, EngineCore(engine_config, loaded))
        app = create_app(engine, config)
        async with app.router.lifespan_context(app):
            return await body(app, engine)

    return asyncio.run(main())


def post_each(loaded, engine_args: dict, path: str, bodies) -> list[tuple[int, object]]:
    """POST each body to `path`, in turn, on a fresh app over the loaded model (its engine thread
    running): [(status, answer)], a stream's answer being its events before the closing [DONE]."""

    async def post_all(app, engine):
        answers = []
        for body in bodies:
            status, headers, raw = await asgi_request(app, "POST", path, body)
            if headers["content-type"].startswith("text/event-stream"):
                events = sse_events(raw)
                assert events[-1] == "[DONE]"
                answers.append((status, events[:-1]))
            else:
                answers.append((status, json.loads(raw)))
        return answers

    return serve_app(loaded, engine_args, post_all)


class LoopbackServer:
    """uvicorn serving `app` on a free loopback port from a thread of this process, for as long as
    the `with` block lasts; or, given `config` (a uvicorn.Config: its app, host and port), that."""

    def __init__(self, app=None, config=None):
        import uvicorn

        config = config or uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
        self.port = config.port
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="loopback-uvicorn", daemon=True)
        self.app = config.app

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
