"""API keys in-process (plain ASGI calls, no model needed: the middleware answers first): every
path but the chat page needs the key, /health and /metrics too with
--protect-health-and-metrics (open by default); the comparison is constant-time (digests of
equal length through hmac.compare_digest, every key compared, no early exit)."""

from __future__ import annotations

import asyncio
import hmac
import json

import pytest

from blockserve.server.http.auth import AuthMiddleware

KEYS = ("key-a", "key-b")


async def answered(scope, receive, send):
    """The app behind the middleware: 200 for whatever reaches it."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status_of(middleware: AuthMiddleware, path: str, key: str | None = None) -> tuple[int, dict | None]:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    asyncio.run(middleware(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], (json.loads(body) if sent[0]["status"] != 200 else None)


API_PATHS = ["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/reset_prefix_cache", "/openapi.json", "/no/such/route"]


def test_every_api_path_needs_a_key_and_health_and_metrics_are_open_by_default():
    middleware = AuthMiddleware(answered, KEYS)
    for path in API_PATHS:
        status, body = status_of(middleware, path)
        assert status == 401 and body["error"]["code"] == "missing_api_key", (path, body)
        status, body = status_of(middleware, path, "key-c")
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert status_of(middleware, path, "key-b")[0] == 200
    for path in ("/health", "/metrics", "/"):
        assert status_of(middleware, path)[0] == 200, path


def test_protected_health_and_metrics_need_the_key():
    middleware = AuthMiddleware(answered, KEYS, open_operations=False)
    for path in ("/health", "/metrics"):
        status, body = status_of(middleware, path)
        assert status == 401 and body["error"]["code"] == "missing_api_key", path
        assert status_of(middleware, path, "key-a")[0] == 200
    assert status_of(middleware, "/")[0] == 200  # the chat page holds no data


def test_without_keys_everyone_is_let_in():
    middleware = AuthMiddleware(answered, (), open_operations=False)
    assert all(status_of(middleware, path)[0] == 200 for path in [*API_PATHS, "/health", "/metrics"])


@pytest.mark.parametrize("token", ["key-a", "key-b", "k", "key-a-but-much-longer" * 10, "kez-a"])
def test_the_comparison_is_constant_time(monkeypatch, token):
    compared = []

    def recording(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", recording)
    middleware = AuthMiddleware(answered, KEYS)
    assert middleware.accepts(token) == (token in KEYS)
    assert compared == [(32, 32)] * len(KEYS)  # every key, whatever matched; the lengths never differ
