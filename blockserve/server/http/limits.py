"""The limits a request must keep to, checked at the edge before any engine work; each answer
names the limit and the `blockserve serve` flag that sets it (defaults: server/config.py).

    body over --max-request-body-bytes   413 `request_too_large`: refused from its Content-Length,
                                         or as soon as a chunked body's bytes pass the limit; a
                                         body is never held past the limit
    body that stops arriving             408 `body_timeout`, and the connection closed: no piece of
                                         it for --body-timeout seconds (the head's own deadline,
                                         --header-timeout, is header_deadline.py's)
    body not UTF-8                       400 `invalid_encoding`, naming the first bad byte
    JSON nested past --max-json-depth    400 `json_too_deep`, found by a scan before any parse
                                         (so Python's recursive json parser never meets it)
    NaN, Infinity, -Infinity             400 `invalid_json`: Python's parser reads them, JSON
                                         (RFC 8259) has no such numbers
    n, prompts, stop strings             400 `invalid_value` with `param`: --max-n, --max-prompts,
                                         --max-stop, --max-stop-length (`check_request_limits`)
    request_timeout over the server's    400 `invalid_value`: a body may shorten its deadline
                                         (--request-timeout), never lengthen it
    request_timeout under the floor      400 `invalid_value`: a deadline no engine step can meet
                                         (--min-request-timeout, default 0.001 s)

`max_tokens` has no server cap: past the model's length (prompt + max_tokens) the scheduler's
PromptTooLong is a 400 `context_length_exceeded` before the request is scheduled.
"""

from __future__ import annotations

import asyncio
import re
from itertools import accumulate

from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import APIError, error_response
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_NOT_A_NUMBER = re.compile(r"-?\b(?:NaN|Infinity)\b")  # outside strings: what json.loads takes beyond JSON


class RequestLimitsMiddleware:
    """Reads each HTTP body up to `max_body_bytes`, waiting at most `body_timeout` seconds for each
    piece, refuses it (413 / 400 / 408) if it is too large, not UTF-8, nested deeper than
    `max_json_depth` or too slow, else hands the app the same body. Plain ASGI: after the body,
    `receive` is the client's own, so disconnect detection is unchanged."""

    def __init__(self, app, *, max_body_bytes: int, max_json_depth: int, body_timeout: float):
        self.app = app
        self.max_body_bytes, self.max_json_depth, self.body_timeout = max_body_bytes, max_json_depth, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await error_response(self._too_large(declared.decode("latin-1")))(scope, receive, send)
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                return await error_response(self._too_slow(), close=True)(scope, receive, send)
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await error_response(self._too_large(f"over {self.max_body_bytes}"))(scope, receive, send)
            if not message.get("more_body", False):
                break
        problem = body_problem(bytes(body), self.max_json_depth)
        if problem is not None:
            return await error_response(problem)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _too_slow(self) -> APIError:
        return APIError(408, f"the request body stopped arriving: nothing of it for {self.body_timeout:g} s "
                             f"(--body-timeout); the connection was closed", code="body_timeout")

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body ({size} bytes) is larger than this server's limit of "
                             f"{self.max_body_bytes} bytes (--max-request-body-bytes)", code="request_too_large")


def body_problem(body: bytes, max_json_depth: int) -> APIError | None:
    """A 400 for a body that is not UTF-8, is nested deeper than `max_json_depth` or holds NaN or
    an infinity; else None. Whether it is otherwise valid JSON is the parser's to say."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(400, f"the request body is not valid UTF-8: byte {e.start} (0x{body[e.start]:02x}) "
                             f"{e.reason}; send JSON encoded as UTF-8", code="invalid_encoding")
    outside_strings = _STRING.sub('""', text)
    depth = json_depth(outside_strings)
    if depth > max_json_depth:
        return APIError(400, f"the request body's JSON is nested {depth} levels deep; this server allows "
                             f"{max_json_depth} (--max-json-depth)", code="json_too_deep")
    number = _NOT_A_NUMBER.search(outside_strings)
    if number is not None:
        return APIError(400, f"the request body is not valid JSON: {number.group()} is not a JSON number (JSON has "
                             f"no NaN or infinities); send a finite number, or leave the field out",
                        code="invalid_json")
    return None


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON `text` nest (0 for a scalar), brackets inside
    strings not counted. Linear and non-recursive; on invalid JSON a bound the parser refuses anyway."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def check_request_limits(body: CompletionRequest | ChatCompletionRequest, config: ServerConfig) -> None:
    """Raise a 400 APIError naming the first of --max-n, --max-prompts, --max-stop,
    --max-stop-length and the deadline's bounds (--request-timeout, --min-request-timeout) that
    `body` goes past."""
    if body.n > config.max_n:
        raise _over("n", f"n is {body.n}", config.max_n, "samples", "--max-n")
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > config.max_prompts:
        raise _over("prompt", f"{len(prompt)} prompts were given", config.max_prompts, "prompts per request",
                    "--max-prompts")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > config.max_stop:
        raise _over("stop", f"{len(stop)} stop strings were given", config.max_stop, "stop strings", "--max-stop")
    longest = max(stop, key=len, default="")
    if len(longest) > config.max_stop_length:
        raise _over("stop", f"a stop string is {len(longest)} characters long", config.max_stop_length,
                    "characters per stop string", "--max-stop-length")
    if body.request_timeout is not None and body.request_timeout > config.request_timeout:
        raise APIError(400, f"request_timeout: {body.request_timeout:g} s is longer than this server allows "
                            f"({config.request_timeout:g} s, --request-timeout); ask for at most that",
                       param="request_timeout", code="invalid_value")
    if body.request_timeout is not None and body.request_timeout < config.min_request_timeout:
        raise APIError(400, f"request_timeout: {body.request_timeout:g} s is shorter than the shortest deadline this "
                            f"server accepts ({config.min_request_timeout:g} s, --min-request-timeout): no engine step "
                            f"finishes that soon; ask for at least that", param="request_timeout", code="invalid_value")


def _over(param: str, what: str, limit: int, unit: str, flag: str) -> APIError:
    return APIError(400, f"{param}: {what}; this server allows at most {limit} {unit} ({flag})",
                    param=param, code="invalid_value")
