"""One HTTP request straight into an ASGI app, no server or socket (the in-process server tests)."""

from __future__ import annotations

import asyncio
import json


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


def post_each(loaded, engine_args: dict, path: str, bodies) -> list[tuple[int, object]]:
    """POST each body to `path`, in turn, on a fresh app over the loaded model (its engine thread
    running): [(status, answer)], a stream's answer being its events before the closing [DONE]."""
    from blockserve.engine.config import EngineConfig
    from blockserve.engine.core import EngineCore
    from blockserve.engine.llm_engine import LLMEngine
    from blockserve.server.app import create_app

    async def main():
        config = EngineConfig(model=loaded.source, **engine_args)
        app = create_app(LLMEngine(config, EngineCore(config, loaded)))
        answers = []
        async with app.router.lifespan_context(app):
            for body in bodies:
                status, headers, raw = await asgi_request(app, "POST", path, body)
                if headers["content-type"].startswith("text/event-stream"):
                    events = sse_events(raw)
                    assert events[-1] == "[DONE]"
                    answers.append((status, events[:-1]))
                else:
                    answers.append((status, json.loads(raw)))
        return answers

    return asyncio.run(main())
