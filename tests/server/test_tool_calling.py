"""Tool calling through `blockserve serve` on the bundled SmolLM2 (whose template has no tools
section: the grammar-enforced envelope of server/tools.py), with the official openai client:
auto / required / named / none, parallel_tool_calls, streaming deltas in OpenAI's shape, and a
multi-turn exchange with a tool result."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow  # the bundled `blockserve serve` process (tests/server/conftest.py)

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture
def server(bundled_server):
    return bundled_server


@pytest.fixture
def client(bundled_client):
    return bundled_client


def ask(client, messages=QUESTION, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=80, **kwargs).choices[0]


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_parse_and_match_their_schema(client, choice):
    answer = ask(client, tool_choice=choice)
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    names = ("get_time",) if isinstance(choice, dict) else tuple(SCHEMAS)
    assert_valid_calls(answer.message.tool_calls, names)
    if isinstance(choice, dict):
        assert len(answer.message.tool_calls) == 1


def test_auto_is_a_valid_call_or_a_plain_reply(client):
    for question in (QUESTION, [{"role": "user", "content": "Say hello to me."}]):
        answer = ask(client, question, tool_choice="auto", parallel_tool_calls=False)  # the small model repeats calls
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls"
            assert_valid_calls(answer.message.tool_calls)
        else:
            assert answer.finish_reason == "stop" and isinstance(answer.message.content, str)


def test_parallel_tool_calls_false_allows_one_call(client):
    messages = [{"role": "user", "content": "What is the weather in Paris, and in Rome, and the time in UTC?"}]
    answer = ask(client, messages, tool_choice="required", parallel_tool_calls=False)
    assert len(answer.message.tool_calls) == 1


def test_none_is_plain_text(client):
    answer = ask(client, tool_choice="none")
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.content.startswith('{"')


def test_streamed_calls_in_openai_shape(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=80, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta of a call carries its id, type and name
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and calls
    whole = ask(client, tool_choice="required").message.tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_a_multi_turn_exchange_with_a_tool_result(server, client):
    first = ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.message.tool_calls[0]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
    ]
    answer = ask(client, messages, tool_choice="auto")
    assert answer.finish_reason in ("stop", "tool_calls")
    if answer.message.tool_calls is not None:  # the small model likes to call again
        assert_valid_calls(answer.message.tool_calls)
    # Ban the token that starts "tool_calls", so the model replies, as plain text (streamed too).
    status, tokens = server.request("POST", "/tokenize", {"prompt": '{"tool_calls', "add_special_tokens": False})
    assert status == 200
    no_call = {str(tokens["tokens"][1]): -100}
    answer = ask(client, messages, tool_choice="auto", logit_bias=no_call)
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert "18" in answer.message.content and not answer.message.content.startswith("{")
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                              max_tokens=80, stream=True, logit_bias=no_call)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == answer.message.content
    assert chunks[-1].finish_reason == "stop" and not any(c.delta.tool_calls for c in chunks)


def test_bad_tool_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=bad, max_tokens=8)
    assert e.value.body["param"] == "tools" and "no-such-type" in e.value.body["message"]
    assert ask(client, tool_choice="required").finish_reason == "tool_calls"  # still serving
