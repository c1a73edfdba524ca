"""Inputs at the edge of what a request may hold, sent to a real uvicorn on loopback (tests/server/asgi.py:
LoopbackServer) over a tiny random Llama carrying SmolLM2's tokenizer and chat template: each is
the client's mistake or plain text, answered without a 5xx.

- A deadline shorter than --min-request-timeout (default 0.001 s: no engine step is that short)
  is a 400 naming request_timeout and the smallest accepted value, before any engine work;
  a deadline at the floor is taken (then met or a real 504).
- A seed past 64 bits, or a logit_bias key that is not a token id in decimal, is a 400; an
  integer written with a zero fraction (2.0) is that integer, as JSON Schema says.
- Text that cannot be encoded (a lone UTF-16 surrogate, legal in JSON as "\\ud800") in any
  field of any endpoint is a 400 `invalid_encoding` whose param is the field's path, decided
  before the request reaches the engine. NUL, valid surrogate pairs, very long single tokens and
  invalid JSON escapes are answered as the text (or JSON) they are: never a 5xx. A Hypothesis
  fuzz puts such strings in every text field (a fixed draw: derandomized, so it cannot flake).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockserve.engine.config import EngineConfig
from blockserve.engine.core import EngineCore
from blockserve.engine.llm_engine import LLMEngine
from blockserve.server.app import create_app
from blockserve.server.config import ServerConfig
from tests.server.asgi import LoopbackServer
from tests.server.test_request_fields import ARGS, chat_model  # noqa: F401 (a fixture)

COMPLETION = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811 (the fixture imported above)
    engine_config = EngineConfig(model=chat_model.source, **ARGS)
    engine = LLMEngine(engine_config, EngineCore(engine_config, chat_model))
    with LoopbackServer(create_app(engine, ServerConfig())) as loopback:
        yield loopback


def post(server: LoopbackServer, path: str, body) -> tuple[int, dict | str]:
    """(status, the JSON answer or a stream's text) of POST `body` (JSON-able, or raw bytes)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # lone surrogates as \\udxxx escapes
    request = urllib.request.Request(f"{server.base_url}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def error_of(status: int, answer) -> dict:
    assert isinstance(answer, dict) and set(answer) == {"error"}, (status, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


# -- deadlines -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("deadline", [5e-324, 1e-9, 0.0009])
def test_a_deadline_under_the_floor_is_a_400_naming_the_smallest_accepted(server, path, base, deadline):
    status, answer = post(server, path, {**base, "request_timeout": deadline})
    error = error_of(status, answer)
    assert status == 400 and error["param"] == "request_timeout" and error["code"] == "invalid_value", answer
    assert "0.001 s" in error["message"] and "--min-request-timeout" in error["message"], error


def test_a_deadline_at_the_floor_is_taken(server):
    status, answer = post(server, "/v1/completions", {**COMPLETION, "request_timeout": 0.001})
    assert status in (200, 504), answer  # met, or a real expiry: never refused
    if status == 504:
        assert error_of(status, answer)["code"] == "request_timeout"


def test_the_floor_is_a_serve_flag_and_below_the_ceiling():
    from blockserve.cli import build_parser, server_config

    args = build_parser().parse_args(["serve", "--min-request-timeout", "0.5"])
    assert server_config(args).min_request_timeout == 0.5 and ServerConfig().min_request_timeout == 0.001
    with pytest.raises(ValueError, match="min_request_timeout"):
        ServerConfig(min_request_timeout=10, request_timeout=5)
    with pytest.raises(ValueError, match="min_request_timeout"):
        ServerConfig(min_request_timeout=0)


# -- numbers and ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2 ** 63, -2 ** 63 - 1, 10 ** 30])
def test_a_seed_past_64_bits_is_a_400(server, seed):
    """It reached the worker's generator, which cannot take it: the engine step failed (a 500)."""
    status, answer = post(server, "/v1/completions", {**COMPLETION, "seed": seed})
    error = error_of(status, answer)
    assert status == 400 and error["param"] == "seed", error


def test_integers_written_with_a_zero_fraction_are_integers(server):
    """JSON Schema's `integer` takes 2.0, as a generated client may send it; 2.5, true and "2" stay refused."""
    status, answer = post(server, "/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 2.0, "n": 2.0,
                                                      "temperature": 0, "seed": 3.0})
    assert status == 200 and len(answer["choices"]) == 2 and answer["usage"]["completion_tokens"] <= 4, answer
    for bad in ({"n": 2.5}, {"n": True}, {"n": "2"}, {"max_tokens": 1.5}):
        status, answer = post(server, "/v1/completions", {**COMPLETION, **bad})
        assert status == 400 and error_of(status, answer)["param"] == next(iter(bad)), answer


def test_chat_max_tokens_over_the_model_length_is_a_400_even_beside_max_completion_tokens(server):
    """max_completion_tokens wins, but a max_tokens no request could use is refused as alone (the
    document bounds each field by itself)."""
    status, answer = post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1, "max_tokens": 10 ** 6})
    error = error_of(status, answer)
    assert status == 400 and error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
    status, answer = post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1,
                                                           "max_tokens": ARGS["max_model_len"] - 1})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1, answer


@pytest.mark.parametrize("key", ["007", " 7", "+7", "7_0", "-1", "1e2", "٣"])
def test_a_logit_bias_key_is_a_token_id_written_in_decimal(server, key):
    status, answer = post(server, "/v1/completions", {**COMPLETION, "logit_bias": {key: 1}})
    error = error_of(status, answer)
    assert status == 400 and error["param"] == "logit_bias" and "token ids" in error["message"], error


# -- text ------------------------------------------------------------------------------------------

# (endpoint, a valid body with TEXT where the text goes, the param naming that field)
TEXT = "\x00TEXT\x00"
TEXT_FIELDS = [
    ("/v1/completions", {**COMPLETION, "prompt": TEXT}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["Hi", TEXT]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "stop": [TEXT]}, "stop.0"),
    ("/v1/completions", {**COMPLETION, "user": TEXT}, "user"),
    ("/v1/completions", {**COMPLETION, "cache_salt": TEXT}, "cache_salt"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["a", TEXT]}}, "structured_outputs.choice.1"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": TEXT}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": TEXT}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": [{"type": "text", "text": TEXT}]}]},
     "messages.1.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi", "name": TEXT}]},
     "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"k": TEXT}}, "metadata.k"),
    ("/v1/chat/completions", {**CHAT, "stop": TEXT}, "stop"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"k": TEXT}}, "chat_template_kwargs.k"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": "' + TEXT + '"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "tool_call_id": TEXT, "content": "1"}]},
     "messages.0.tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "description": TEXT, "parameters": {"type": "object"}}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "description": TEXT}}}},
     "response_format.json_schema.schema.description"),
    ("/tokenize", {"prompt": TEXT}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": TEXT}]}, "messages.0.content"),
]


def with_text(body, text: str):
    """`body` with TEXT replaced by `text` wherever it stands (a value or a part of one)."""
    if isinstance(body, dict):
        return {k: with_text(v, text) for k, v in body.items()}
    if isinstance(body, list):
        return [with_text(v, text) for v in body]
    return body.replace(TEXT, text) if isinstance(body, str) else body


def unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@pytest.mark.parametrize("path, body, param", TEXT_FIELDS, ids=[f"{p} {q}" for p, _, q in TEXT_FIELDS])
@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "end\udbff", "\udc00\ud800"])
def test_text_that_cannot_be_encoded_is_a_400_naming_the_field(server, path, body, param, text):
    status, answer = post(server, path, with_text(body, text))
    error = error_of(status, answer)
    assert status == 400 and error["code"] == "invalid_encoding" and error["param"] == param, error
    assert param in error["message"] and "surrogate" in error["message"], error


def test_a_dict_key_that_cannot_be_encoded_is_named_too(server):
    status, answer = post(server, "/v1/chat/completions", {**CHAT, "metadata": {"\ud800": "v"}})
    error = error_of(status, answer)
    assert status == 400 and error["code"] == "invalid_encoding" and error["param"] == "metadata", error


@pytest.mark.parametrize("path, body, param", TEXT_FIELDS, ids=[f"{p} {q}" for p, _, q in TEXT_FIELDS])
@pytest.mark.parametrize("text", ["\x00", "a\x00b", "\ud83d\ude00", "\U0010ffff", "x" * 300])
def test_text_that_can_be_encoded_is_answered_as_text(server, path, body, param, text):
    """NUL, a surrogate pair (sent as its two escapes, one character once parsed), the last code
    point, a 300-character single token."""
    status, answer = post(server, path, with_text(body, text))
    assert status < 500, (status, answer)
    if status >= 400:
        assert error_of(status, answer)["code"] != "invalid_encoding", answer


@pytest.mark.parametrize("path, base, field", [("/v1/completions", COMPLETION, "prompt"),
                                               ("/tokenize", {"prompt": "x"}, "prompt")])
def test_a_very_long_single_token_is_refused_by_length_not_by_a_5xx(server, path, base, field):
    status, answer = post(server, path, {**base, field: "a" * 200_000})  # one word, ~50k tokens
    if path == "/tokenize":
        assert status == 200 and answer["count"] > ARGS["max_model_len"], answer
    else:
        error = error_of(status, answer)
        assert status == 400 and error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize("raw", [b'{"prompt": "\\x41"}', b'{"prompt": "\\u12"}', b'{"prompt": "\\ud80"}',
                                 b'{"prompt": "a\x00b"}', b'{"prompt": "\\'])
def test_an_invalid_escape_is_invalid_json(server, raw):
    status, answer = post(server, "/v1/completions", raw)
    assert status == 400 and error_of(status, answer)["code"] == "invalid_json", answer


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1": NaN}}'),
    ("/v1/completions", b'{"prompt": "Hi", "structured_outputs": {"json": {"type": "number", "maximum": Infinity}}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"x": -Infinity}}'),
    ("/tokenize", b'{"prompt": "Hi", "add_special_tokens": NaN}'),
])
def test_nan_and_infinity_are_invalid_json(server, path, raw):
    """Python's parser reads them, JSON (RFC 8259) has no such numbers: refused as what they are,
    not taken into a template or a schema. Inside a string they are text."""
    status, answer = post(server, path, raw)
    error = error_of(status, answer)
    assert status == 400 and error["code"] == "invalid_json" and "NaN" in error["message"], error
    status, answer = post(server, "/v1/completions", b'{"prompt": "NaN -Infinity", "max_tokens": 1}')
    assert status == 200, answer


# Pieces of text: lone surrogates, NUL, a surrogate pair as JSON sends it (two escapes the parser
# joins into one character), the last code point, any character.
HOSTILE = st.lists(st.one_of(st.characters(codec=None, categories=["Cs"]),
                             st.sampled_from(["\x00", "\ud83d\ude00", "\U0010ffff", "a"]),
                             st.characters()), max_size=12).map("".join)
LONG = st.integers(1, 3).map(lambda k: "z" * (10 ** (k + 1)))  # up to a 10k-character single token


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(field=st.sampled_from(TEXT_FIELDS), text=st.one_of(HOSTILE, LONG))
def test_fuzzed_text_in_any_field_is_a_400_exactly_when_it_cannot_be_encoded(server, field, text):
    path, body, param = field
    status, answer = post(server, path, with_text(body, text))
    assert status < 500, (status, answer)
    code = error_of(status, answer)["code"] if status >= 400 else None
    if unencodable(json.loads(json.dumps(text))):  # as the server parses it: adjacent halves make a pair
        assert status == 400 and code == "invalid_encoding" and answer["error"]["param"] == param, answer
    else:
        assert code != "invalid_encoding", answer


# -- methods ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, allowed", [("TRACE", "/v1/completions", "POST"), ("GET", "/tokenize", "POST"),
                                                   ("DELETE", "/v1/models", "GET")])
def test_an_undeclared_method_is_a_405_with_allow(server, method, path, allowed):
    """RFC 9110: a 405 lists the methods the resource takes (schemathesis' ST204)."""
    request = urllib.request.Request(f"{server.base_url}{path}", method=method)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 405 and allowed in refused.value.headers.get("Allow", "").split(", "), \
        refused.value.headers
    assert json.loads(refused.value.read())["error"]["code"] == "method_not_allowed"
