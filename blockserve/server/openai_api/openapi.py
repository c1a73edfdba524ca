"""The OpenAPI document served at GET /openapi.json: FastAPI's schema of the request models, with
their real constraints (ranges, unknown fields refused), and the answers the routes really give.

    every route          401 (with --api-key), 500, in OpenAI's error shape
    every POST           400 (invalid JSON, encoding, nesting, values), 413 (body size)
    generation routes    200 as JSON or, with `stream: true`, text/event-stream; 503 (overloaded,
                         draining, engine stopped), 504 (past the request's deadline)
    /health              200 (no body) or 503

FastAPI's own 422 is removed everywhere: validation errors are 400s (http/errors.py). The
tokenize routes read their bodies themselves (tokenize.py), so their request schema is added
here. What the routes check beyond the models (this server's limits and engine, fields that need
or exclude each other) is written in by request_rules.py. The document is built once, on first
request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from blockserve.server.openai_api.request_rules import Limits, constrain
from blockserve.server.protocol import DetokenizeRequest, ErrorResponse, TokenizeChatRequest, TokenizeRequest

_ERROR_STATUSES = {
    400: "Invalid request: the message says which field or limit, and what to do",
    401: "Missing or wrong API key",
    404: "Unknown route",
    409: "Not possible now (the reason is in the message)",
    413: "Request body over --max-request-body-bytes",
    500: "Internal error (the traceback is in the server's log)",
    503: "Overloaded, draining, too many connections, or the engine stopped (Retry-After says when to retry, "
         "where it can)",
    504: "Past the request's deadline (request_timeout / --request-timeout); aborted",
}
_REF = "#/components/schemas/{model}"
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_SELF_READ_BODIES = {"/tokenize": (TokenizeRequest, TokenizeChatRequest), "/detokenize": (DetokenizeRequest,)}


def answers(*statuses: int, ok: type[BaseModel] | dict | None = None, stream: bool = False,
            ok_media: str | None = None) -> dict[int | str, dict[str, Any]]:
    """A route's documented answers: 200 (`ok`'s JSON, a model or a JSON schema; also
    text/event-stream if `stream`; or `ok_media`; or no body), then each error status in
    `statuses` (plus 401 and 500) in OpenAI's shape."""
    success: dict[str, Any] = {"description": "Success"}
    content = {ok_media: {"schema": {"type": "string"}}} if ok_media else {}
    if stream:  # each event: `data:` a chunk's JSON, an error's (OpenAI's shape), or the final [DONE]
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    if isinstance(ok, dict):
        content["application/json"] = {"schema": ok}
    elif ok is not None:
        success["model"] = ok
    if content:
        success["content"] = content
    documented: dict[int | str, dict[str, Any]] = {200: success}
    for status in sorted({*statuses, 401, 500}):
        documented[status] = {"description": _ERROR_STATUSES[status], "model": ErrorResponse}
    return documented


def install_openapi(app: FastAPI, limits: Callable[[], Limits]) -> None:
    """Make `app.openapi()` (what /openapi.json serves) the document described above, for the
    server and engine `limits()` describes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, limits())
        return app.openapi_schema

    app.openapi = openapi


def _build(app: FastAPI, limits: Limits) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="blockserve: an OpenAI-compatible server (errors in OpenAI's shape)")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for operation in (op for path in document["paths"].values() for op in path.values()):
        responses = operation.get("responses", {})
        responses.pop("422", None)
        success = responses.get("200", {}).get("content", {})
        if success.get("application/json") == {"schema": {}}:  # FastAPI's guess for a route that returns a Response
            del success["application/json"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, models in _SELF_READ_BODIES.items():
        refs = []
        for model in models:
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            refs.append({"$ref": _REF.format(model=model.__name__)})
        content = {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
        document["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": content}}
    constrain(schemas, limits)
    return document
