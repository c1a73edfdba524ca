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
