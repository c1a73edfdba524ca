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
from blockserve.server.http_errors import APIError, error_response

PROTECTED_PREFIXES = ("/v1/", "/reset_prefix_cache")


class AuthMiddleware:
    """401 for protected paths without one of the accepted bearer tokens (plain ASGI, so it
    leaves streaming and disconnect detection alone). No keys: everyone is let in."""

    def __init__(self, app, api_keys: Sequence[str]):
        self.app = app
        self.keys = [key.encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"].startswith(PROTECTED_PREFIXES):
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
            if token is None:
                error = APIError(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                                 code="missing_api_key")
                await error_response(error)(scope, receive, send)
                return
            if not any(hmac.compare_digest(token.encode("latin-1"), key) for key in self.keys):
                await error_response(APIError(401, "invalid API key", code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
