"""GET /: the chat page (static/chat.html), one self-contained file shipped as package data.

It talks to this server only: /v1/models for the model name, /v1/chat/completions streamed
for replies. Its Content-Security-Policy allows nothing else (no CDN, no other origin), so a
page that tried to load an outside resource would fail visibly in the browser test. The page
itself needs no API key (it holds no data); its calls send the key typed into it.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def chat_page_router() -> APIRouter:
    """A router serving the page at GET /; the file is read once, here."""
    page = (files("blockserve.server.http") / "static" / "chat.html").read_text(encoding="utf-8")
    headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers=headers)

    return router
