"""Errors as HTTP answers in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.

    InvalidRequest (RequestRejected, PromptTooLong)  400, with the error's code and param
    pydantic's validation errors, malformed JSON    400 (not FastAPI's 422)
    text that cannot be encoded (a lone surrogate)  400 `invalid_encoding`, `param` the string's path
    an unknown or unsupported field                 400 `unsupported_parameter`, `param` its full path
    a missing or wrong API key                      401 (auth.py)
    a request past a limit                          400, or 413 for the body's size (limits.py)
    a client too slow to send its request           408 `header_timeout` / `body_timeout`, connection
                                                    closed (header_deadline.py, limits.py)
    unknown route / method                          404 / 405 (with Allow)
    EngineDead                                      503
    RequestTimeout                                  504: past its deadline (--request-timeout or the
                                                    body's request_timeout); aborted
    RequestFailed                                   500: the engine step running it failed (logged)
    StreamStalled                                   408, in a stream's error event: the client read
                                                    nothing for --stream-stall-timeout; aborted
    Unavailable (Overloaded, Draining, ShutdownTimeout, TooManyConnections)  503 with Retry-After: the
                                                    queue is full, the server drains, or it holds
                                                    --max-connections connections; may succeed later
    anything else                                   500 "internal server error"; the traceback is logged,
                                                    never sent
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockserve.errors import EngineDead, InvalidRequest
from blockserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("blockserve.server")


class APIError(Exception):
    """An answer other than 2xx; raise it from a route (or return `error_response(it)`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


class Unavailable(APIError):
    """503 with a Retry-After of `retry_after` seconds: not this request's fault; it may succeed later
    (or on another replica). `reason` labels the rejection in the metrics."""

    reason = "unavailable"

    def __init__(self, message: str, *, code: str, retry_after: int = 1):
        super().__init__(503, message, code=code, retry_after=retry_after)


class Overloaded(Unavailable):
    """The waiting queue is at a bound (`reason`: waiting_requests or waiting_tokens)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message, code="server_overloaded")
        self.reason = reason


class Draining(Unavailable):
    """The server is shutting down: it finishes what it has and takes nothing new."""

    reason = "draining"

    def __init__(self):
        super().__init__("the server is shutting down: it finishes the requests it has and takes no new ones; "
                         "retry on another replica or once it is back", code="server_draining")


class ShutdownTimeout(Unavailable):
    """A request still running when the drain's time ran out; it was aborted."""

    reason = "shutdown_timeout"

    def __init__(self, timeout: float):
        super().__init__(f"the server shut down before this request finished (in-flight requests get {timeout:g} s: "
                         f"--shutdown-timeout); retry it", code="shutdown_timeout")


class TooManyConnections(Unavailable):
    """A connection opened while the server already held `limit` (connection_cap.py); it is closed
    after this answer."""

    def __init__(self, limit: int):
        super().__init__(f"the server holds as many connections as it allows ({limit}, --max-connections); this "
                         f"connection is closed: retry shortly, or reuse a connection you hold",
                         code="too_many_connections")


class RequestTimeout(APIError):
    """A request past its deadline; it was aborted (its blocks freed). 504, not 408: the request
    arrived whole and in time (408 says the client was slow to send it); it is the server that
    did not answer in time, as a gateway whose upstream is too slow."""

    def __init__(self, timeout: float):
        super().__init__(504, f"the request did not finish within its deadline of {timeout:g} s and was aborted "
                              f"(the body's request_timeout, else the server's --request-timeout); ask for fewer "
                              f"tokens or a longer deadline", code="request_timeout")


class StreamStalled(APIError):
    """A streaming client that read nothing for `timeout` seconds: its request was aborted."""

    def __init__(self, timeout: float):
        super().__init__(408, f"the client read nothing of this stream for {timeout:g} s (--stream-stall-timeout), "
                              f"so the request was aborted", code="stream_stalled")


class RequestFailed(APIError):
    """The engine step that ran this request raised; the request was aborted, the traceback logged."""

    def __init__(self):
        super().__init__(500, "internal server error: the engine step running this request failed and the request "
                              "was aborted (the traceback is in the server's log); retry it", code="engine_step_failed")


def error_body(error: APIError) -> dict:
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, param=error.param,
                                         code=error.code)).model_dump()


def error_response(error: APIError, *, close: bool = False) -> JSONResponse:
    """`error` as a JSON response; `close`: the server closes the connection after it (the client
    was too slow to be kept)."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    if close:
        headers["Connection"] = "close"
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def from_exception(e: BaseException) -> APIError:
    """What a request's failure means to the client; anything unexpected is logged with its
    traceback and answered with a 500 that reveals nothing."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequest):
        return APIError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_unavailable")
    logger.exception("request failed: %s: %s", type(e).__name__, e, exc_info=e)
    return APIError(500, "internal server error", code="internal_error")


_REFUSED = ("extra_forbidden", "unsupported_parameter")  # a field not in the spec; one protocol.py refuses


def from_validation_error(exc: RequestValidationError) -> APIError:
    """The first of pydantic's complaints, naming the field (and how many more there are)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    # A refused field says most about what to change; within a union it may not come first.
    first = next((e for e in errors if e.get("type") in _REFUSED), errors[0])
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}",
                        code="invalid_json")
    if first.get("type") == "unencodable_text":  # protocol.py: named by its own path, found before any field
        return APIError(400, first["msg"], param=first["ctx"]["where"], code="invalid_encoding")
    if first.get("type") in _REFUSED:  # named in full: `messages.0.tool_calls`, not just `messages`
        where = ".".join(part for part in loc if "[" not in part) or "body"  # without union members' tags
        message = (f"unknown or unsupported field {where!r}: this server does not implement it; remove it"
                   if first["type"] == "extra_forbidden" else f"{where}: {first.get('msg')}")
        return APIError(400, message, param=where, code="unsupported_parameter")
    # A union (e.g. `prompt`) reports one error per member; the field's name says enough.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}{more}", param=param, code="invalid_value")


def add_exception_handlers(app: FastAPI) -> None:
    """Answer every error a route raises in OpenAI's shape (see the table above)."""

    async def on_error(request: Request, exc: Exception):
        return error_response(from_exception(exc))

    for error_type in (APIError, InvalidRequest, EngineDead):
        app.add_exception_handler(error_type, on_error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_response(APIError(exc.status_code, message, code=codes.get(exc.status_code)))
        response.headers.update(exc.headers or {})  # a 405's Allow: the methods the route takes (RFC 9110)
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, "internal server error", code="internal_error"))
