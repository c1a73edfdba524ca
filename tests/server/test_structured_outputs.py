"""Structured outputs and logit_bias through `blockserve serve` on the bundled SmolLM2, with the
official openai client: `chat.completions.parse` with a pydantic model, json_schema outputs
valid for a concurrent batch mixed with unconstrained requests (which answer as they do alone),
regex / choice / grammar on both endpoints, json_object, streaming, the 400s (an uncompilable
schema, conflicting fields, bad logit_bias) after which the server keeps serving, and
logit_bias moving the greedy token."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # the bundled `blockserve serve` process (tests/server/conftest.py)

MODEL = "SmolLM2-135M-Instruct"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    job: Literal["teacher", "doctor", "engineer", "artist"]


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "sky": {"enum": ["sunny", "rainy", "cloudy"]},
    "temps": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "sky", "temps"], "additionalProperties": False}


@pytest.fixture
def server(bundled_server):
    return bundled_server


@pytest.fixture
def client(bundled_client):
    return bundled_client


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=user("Describe a teacher called Ann as JSON."), response_format=Person,
        temperature=0, max_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person), choice.message.content


def test_json_schema_batch_mixed_with_unconstrained_requests(client):
    questions = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
                 "Write a haiku about autumn."]
    cities = ["Paris", "Oslo", "Lima", "Cairo"]

    def plain(q):
        return client.chat.completions.create(model=MODEL, messages=user(q), temperature=0, max_tokens=24)

    def weather(city):
        return client.chat.completions.create(
            model=MODEL, messages=user(f"Describe the weather in {city} as JSON."), temperature=0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                                    "strict": True}})

    alone = [plain(q).choices[0].message.content for q in questions]
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(weather, c) for c in cities]
        unconstrained = [pool.submit(plain, q) for q in questions]
        for future in constrained:
            choice = future.result().choices[0]
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
            assert choice.finish_reason == "stop"
        assert [f.result().choices[0].message.content for f in unconstrained] == alone


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
    ({"grammar": 'start: "Colour: " COLOUR\nCOLOUR: "red" | "blue"'}, lambda t: t in ("Colour: red", "Colour: blue")),
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["n"], "additionalProperties": False}}, lambda t: 0 <= json.loads(t)["n"] <= 99),
], ids=["regex", "choice", "gbnf", "lark", "json"])
def test_structured_outputs_on_both_endpoints(client, constraint, check):
    chat = client.chat.completions.create(model=MODEL, messages=user("Answer briefly: what colour is the sky?"),
                                          temperature=0, max_tokens=40, extra_body={"structured_outputs": constraint})
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="Q: What colour is the sky?\nA:", temperature=0,
                                           max_tokens=40, extra_body={"structured_outputs": constraint})
    assert check(completion.choices[0].text), completion.choices[0].text
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Give me a JSON object with the name and age of a cat."), temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"}, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_refusals_are_400s_and_the_server_keeps_serving(client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}
    cases = [
        (dict(response_format=bad_schema), "response_format", "no-such-type"),
        (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs", "unclosed group"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs",
         "exactly one of"),
        (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
         "structured_outputs", "not both"),
        (dict(response_format={"type": "json_schema"}), "response_format", "needs json_schema"),
        (dict(extra_body={"structured_outputs": {"structural_tag": {"x": 1}}}), "structured_outputs.structural_tag",
         "structural tags are not supported"),
        (dict(logit_bias={"49152": 1}), "logit_bias", "[0, 49152)"),
        (dict(logit_bias={"abc": 1}), "logit_bias", "must be token ids"),
        (dict(logit_bias={"5": 101}), None, "[-100, 100]"),
        (dict(ignore_eos=True, extra_body={"ignore_eos": True, "structured_outputs": {"regex": "a"}}), None,
         "ignore_eos cannot be combined"),
    ]
    for kwargs, param, reason in cases:
        extra = kwargs.pop("extra_body", {})
        kwargs.pop("ignore_eos", None)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=8, extra_body=extra, **kwargs)
        error = e.value.body
        assert reason in error["message"], error
        if param is not None:
            assert error["param"] == param, error
    ok = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=4,
                                        extra_body={"structured_outputs": {"choice": ["fine"]}})
    assert ok.choices[0].message.content == "fine"


def test_logit_bias_moves_the_greedy_token(server, client):
    prompt = "The capital of France is"
    first = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1, logprobs=2)
    greedy = first.choices[0].text
    top = first.choices[0].logprobs.top_logprobs[0]
    runner_up = next(t for t in sorted(top, key=top.get, reverse=True) if t != greedy)
    status, tokenized = server.request("POST", "/tokenize", {"prompt": greedy, "add_special_tokens": False})
    assert status == 200, tokenized
    [greedy_id] = tokenized["tokens"]
    banned = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                       logit_bias={str(greedy_id): -100})
    assert banned.choices[0].text == runner_up
    forced = client.chat.completions.create(model=MODEL, messages=user("Hi"), temperature=0, max_tokens=3,
                                            logit_bias={str(greedy_id): 100})
    assert forced.choices[0].message.content == greedy * 3
    assert client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                     logit_bias={}).choices[0].text == greedy
