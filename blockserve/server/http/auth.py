"""Who is calling: API-key checks, and the prefix-cache salt derived from the caller (C6).

With `prefix_cache_isolation="per-key"` a request's salt is a hash of its bearer token, then its
body's `cache_salt`: tenants never share cached blocks and cannot name each other's salt.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi import Request

from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import APIError, error_response

PUBLIC_PATHS = frozenset({"/"})  # the chat page holds no data; its own calls send the key
OPERATIONS_PATHS = frozenset({"/health", "/metrics"})  # open unless --protect-health-and-metrics


class AuthMiddleware:
    """401 without one of the accepted bearer tokens, on every path but the public ones (and
    /health and /metrics while `open_operations`, for load balancers and scrapers, as vLLM does).
    Plain ASGI, so it leaves streaming and disconnect detection alone. No keys: everyone is let in.

    The comparison takes the same time whatever the token: both sides are SHA-256 digests (equal
    lengths), compared with `hmac.compare_digest`, against every key (no early exit)."""

    def __init__(self, app, api_keys: Sequence[str], open_operations: bool = True):
        self.app = app
        self.key_digests = [_digest(key.encode()) for key in api_keys]
        self.open_paths = PUBLIC_PATHS | OPERATIONS_PATHS if open_operations else PUBLIC_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key_digests and scope["path"] not in self.open_paths:
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
            if token is None:
                error = APIError(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                                 code="missing_api_key")
                await error_response(error)(scope, receive, send)
                return
            if not self.accepts(token):
                await error_response(APIError(401, "invalid API key", code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def accepts(self, token: str) -> bool:
        digest = _digest(token.encode("latin-1"))
        matched = False
        for key_digest in self.key_digests:
            matched |= hmac.compare_digest(digest, key_digest)
        return matched


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    scheme, _, token = header.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def cache_salt(config: ServerConfig, request: Request, body_salt: str | None) -> str | None:
    """The request's prefix-cache salt: the body's, scoped by the caller's key under per-key isolation."""
    if config.prefix_cache_isolation == "none":
        return body_salt
    token = bearer_token(request.headers.get("authorization", ""))
    tenant = "anonymous" if token is None else hashlib.sha256(token.encode()).hexdigest()
    return tenant if body_salt is None else f"{tenant}:{body_salt}"
