"""The limits at the edge (server/limits.py): each one hit is a 400 (413 for the body's size)
naming the limit and its flag, the value at the limit passes, and the server answers a correct
request afterwards. In-process (plain ASGI calls) on a tiny random Llama with SmolLM2's
tokenizer (stop strings need one), with small limits so the bodies stay small."""

from __future__ import annotations

import asyncio
import json

import pytest

from blockserve.server.config import MAX_JSON_DEPTH, ServerConfig
from blockserve.server.http.limits import json_depth
from tests.server.asgi import asgi_request, serve_app
from tests.server.test_request_fields import ARGS, chat_model  # noqa: F401 (a fixture)

LIMITS = ServerConfig(max_request_body_bytes=400, max_json_depth=5, max_n=3, max_prompts=2, max_stop=2,
                      max_stop_length=5)
OK = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}


def serve(model, body, config: ServerConfig = LIMITS):
    """Run `body(app)` with the app's lifespan (the engine thread) around it."""
    return serve_app(model, ARGS, lambda app, engine: body(app), config)


async def post(app, body, path: str = "/v1/completions") -> tuple[int, dict]:
    status, _, raw = await asgi_request(app, "POST", path, body)
    return status, json.loads(raw)


async def post_chunks(app, chunks: list[bytes], content_length: int | None = None) -> tuple[int, dict, int]:
    """POST /v1/completions with the body sent in `chunks` (chunked unless `content_length`):
    (status, JSON answer, how many chunks the server asked for)."""
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    asked, sent = 0, []

    async def receive():
        nonlocal asked
        if asked < len(incoming):
            asked += 1
            return incoming[asked - 1]
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m for m in sent if m["type"] == "http.response.start")["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")), asked


def assert_refused(answer: tuple[int, dict], status: int, code: str, *words: str, param: str | None = None) -> None:
    got, body = answer
    assert got == status and body["error"]["code"] == code and body["error"]["param"] == param, answer
    assert body["error"]["type"] == "invalid_request_error"
    assert all(word in body["error"]["message"] for word in words), answer


async def assert_still_serves(app) -> None:
    status, answer = await post(app, OK)
    assert status == 200 and answer["usage"]["completion_tokens"] == 1, answer


def padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded with spaces)."""
    raw = json.dumps(OK).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


# -- the checks on their own ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ('"[[["', 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('["\\"[", [[]]]', 3),
    ('{"a": "\\\\", "b": [[]]}', 3), ("[" * 1000 + "]" * 1000, 1000),
])
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


@pytest.mark.parametrize("field", ["max_request_body_bytes", "max_json_depth", "max_n", "max_prompts", "max_stop",
                                   "max_stop_length"])
def test_every_limit_is_at_least_one(field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: 0})


def test_json_depth_stays_under_the_parsers_recursion():
    with pytest.raises(ValueError, match="max_json_depth must be at most"):
        ServerConfig(max_json_depth=MAX_JSON_DEPTH + 1)


# -- through the app ------------------------------------------------------------------------------------------


def test_body_size(chat_model):
    async def body(app):
        assert (await post(app, padded(400)))[0] == 200  # at the limit
        # Content-Length over the limit: refused before a byte of the body is asked for
        status, answer, asked = await post_chunks(app, [padded(401)], content_length=401)
        assert_refused((status, answer), 413, "request_too_large", "401 bytes", "limit of 400 bytes",
                       "--max-request-body-bytes")
        assert asked == 0
        # chunked: refused at the chunk that crosses the limit, the rest never read
        status, answer, asked = await post_chunks(app, [b"[" + b" " * 199, b" " * 200, b" " * 200, b"]"])
        assert_refused((status, answer), 413, "request_too_large", "over 400 bytes", "--max-request-body-bytes")
        assert asked == 3
        status, answer, _ = await post_chunks(app, [padded(400)[:150], padded(400)[150:]])  # chunked, at the limit
        assert status == 200, answer
        await assert_still_serves(app)

    serve(chat_model, body)


def test_invalid_utf8_and_deep_json(chat_model):
    async def body(app):
        bad = b'{"prompt": "caf\xe9", "max_tokens": 1}'  # Latin-1, not UTF-8
        assert_refused(await post(app, bad), 400, "invalid_encoding", "not valid UTF-8", "0xe9")
        assert_refused(await post(app, b"\xff\xfe{}", "/tokenize"), 400, "invalid_encoding", "byte 0")
        assert (await post(app, {**OK, "prompt": "caf\u00e9"}))[0] == 200  # UTF-8 proper
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 1}
        assert (await post(app, parts, "/v1/chat/completions"))[0] == 200  # depth 5: the limit
        assert_refused(await post(app, {**OK, "prompt": [[[[[1]]]]]}), 400, "json_too_deep", "nested 6 levels",
                       "allows 5", "--max-json-depth")
        await assert_still_serves(app)

    serve(chat_model, body)


def test_json_too_deep_for_the_parser_is_a_400_and_the_deepest_allowed_no_500(chat_model):
    async def body(app):
        # far deeper than Python's json parser can recurse: a 400 on every route, the parser never runs
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            assert_refused(await post(app, b"[" * 200_000, path), 400, "json_too_deep", "nested 200000 levels",
                           f"allows {MAX_JSON_DEPTH}")
        nested = b'{"prompt": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"1" + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
        status, answer = await post(app, nested)
        assert status == 400 and answer["error"]["param"] == "prompt", answer  # the shape is wrong, not a crash
        await assert_still_serves(app)

    serve(chat_model, body, ServerConfig(max_json_depth=MAX_JSON_DEPTH))


def test_n_prompts_and_stop_strings(chat_model):
    async def body(app):
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
        for path, request in (("/v1/completions", OK), ("/v1/chat/completions", chat)):
            assert (await post(app, {**request, "n": 3}, path))[0] == 200
            assert_refused(await post(app, {**request, "n": 4}, path), 400, "invalid_value", "n is 4",
                           "at most 3 samples", "--max-n", param="n")
            assert (await post(app, {**request, "stop": ["a", "bcdef"]}, path))[0] == 200
            assert_refused(await post(app, {**request, "stop": ["a", "b", "c"]}, path), 400, "invalid_value",
                           "3 stop strings", "at most 2 stop strings", "--max-stop", param="stop")
            assert_refused(await post(app, {**request, "stop": "abcdef"}, path), 400, "invalid_value",
                           "6 characters long", "at most 5 characters", "--max-stop-length", param="stop")
        assert (await post(app, {**OK, "prompt": ["Hi", "Ho"]}))[0] == 200
        assert (await post(app, {**OK, "prompt": list(range(1, 9))}))[0] == 200  # one prompt of token ids
        assert_refused(await post(app, {**OK, "prompt": [[1], [2], [3]]}), 400, "invalid_value", "3 prompts",
                       "at most 2 prompts", "--max-prompts", param="prompt")
        await assert_still_serves(app)

    serve(chat_model, body)


def test_max_tokens_past_the_models_length_is_a_400(chat_model):
    async def body(app):
        assert_refused(await post(app, {**OK, "max_tokens": 10**20}), 400, "context_length_exceeded",
                       "maximum length of 128")
        await assert_still_serves(app)

    serve(chat_model, body, ServerConfig())
