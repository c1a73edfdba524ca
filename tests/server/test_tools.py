"""The tool-calling envelope without a model: its schema per tool_choice, the history rendering,
the final parse, and the streamed deltas (whatever the text's chunking)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from blockserve.server.http.errors import APIError
from blockserve.server.protocol import ChatCompletionRequest, ToolCall
from blockserve.server.tools.envelope import EnvelopeStream, parse_envelope, render_history, tool_setup

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


CALLS = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                        {"name": "get_time", "arguments": {"zone": "CET"}}]}
REPLY = {"response": "Hello there"}


@pytest.mark.parametrize("choice, parallel, valid, invalid", [
    ("auto", None, [CALLS, REPLY], [{"tool_calls": []}, {"tool_calls": [{"name": "nope", "arguments": {}}]}]),
    ("required", None, [CALLS], [REPLY]),
    ({"type": "function", "function": {"name": "get_time"}}, None,
     [{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}], [CALLS, REPLY]),
    ("auto", False, [REPLY, {"tool_calls": CALLS["tool_calls"][:1]}], [CALLS]),
    ("required", None, [CALLS], [{"tool_calls": [{"name": "get_time", "arguments": {"zone": "PST"}}]}]),
])
def test_the_envelope_schema_per_choice(choice, parallel, valid, invalid):
    setup = tool_setup(request(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel))
    schema = setup.envelope_schema()
    for envelope in valid:
        jsonschema.validate(envelope, schema)
    for envelope in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(envelope, schema)


def test_no_envelope_without_tools_or_with_none():
    assert tool_setup(request()) is None
    assert tool_setup(request(tools=[WEATHER], tool_choice="none")) is None


@pytest.mark.parametrize("fields, message", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}), "not among the tools"),
    (dict(tools=[WEATHER, WEATHER]), "distinct"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "cannot be combined"),
])
def test_bad_combinations_are_400s(fields, message):
    with pytest.raises(APIError, match=message):
        tool_setup(request(**fields))


def test_the_history_renders_calls_and_results():
    setup = tool_setup(request(tools=[WEATHER]))
    call = ToolCall(id="c1", function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "12 C", "tool_call_id": "c1"},
                {"role": "tool", "content": "windy", "tool_call_id": "c1"},
                {"role": "assistant", "content": "It is 12 C."}]
    out = render_history(messages, setup)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can use these tools:\n") and "get_weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    results = [json.loads(line) for line in out[3]["content"].split("\n")]
    assert results == [{"tool_result": {"name": "get_weather", "tool_call_id": "c1", "content": "12 C"}},
                       {"tool_result": {"name": "get_weather", "tool_call_id": "c1", "content": "windy"}}]
    assert json.loads(out[4]["content"]) == {"response": "It is 12 C."}
    assert all(set(m) == {"role", "content"} for m in out)
    with pytest.raises(APIError, match="needs tool_call_id"):
        render_history([{"role": "tool", "content": "x"}], setup)
    bad = ToolCall(id="c2", function={"name": "get_weather", "arguments": "{not json"})
    with pytest.raises(APIError, match="not JSON"):
        render_history([{"role": "assistant", "content": "", "tool_calls": [bad]}], setup)


def test_parse_envelope():
    content, calls = parse_envelope(json.dumps(CALLS, separators=(", ", ": ")))
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"} and calls[0].id.startswith("call_")
    assert parse_envelope('{"response": "Hi \\u00e9"}') == ("Hi é", None)
    assert parse_envelope('{"tool_calls": [{"name"') == ('{"tool_calls": [{"name"', None)


def replay(text: str, size: int) -> tuple[str, dict[int, dict], bool]:
    stream = EnvelopeStream()
    content, calls = "", {}
    for i in range(0, len(text), size):
        piece, deltas = stream.feed(text[i:i + size])
        content += piece
        for d in deltas:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert entry["id"] is None and d.function.name  # the first delta of a call: id and name
                entry.update(id=d.id, name=d.function.name)
            assert entry["id"] is not None
            entry["arguments"] += d.function.arguments or ""
    return content, calls, stream.called


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_rebuild_the_envelope(size):
    calls_text = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "S\u00e3o \"P\" {x}"}},
                                            {"name": "get_time", "arguments": {"zone": "CET", "n": [1, {"a": []}]}}]},
                            separators=(", ", ": "), ensure_ascii=False)
    content, calls, called = replay(calls_text, size)
    assert content == "" and called
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "S\u00e3o \"P\" {x}"},
                                                                    {"zone": "CET", "n": [1, {"a": []}]}]
    reply = '{"response": "Line one\\nan \\u00e9 and \\ud83d\\ude00 \\"quoted\\""}'
    content, calls, called = replay(reply, size)
    assert content == 'Line one\nan \u00e9 and \U0001F600 "quoted"' and calls == {} and not called
