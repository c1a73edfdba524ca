"""Bounded JSON numbers and whitespace (structured/json_bounds.py): the schema rewrite keeps a
schema's own bounds and adds the missing ones; the compiled grammars refuse a 17-digit integral
part, an 11-digit fraction and more whitespace than allowed, and accept everything within; the
bounds are configurable; and on the bundled SmolLM2 a strict schema with an open prompt, which
ran numbers on until max_tokens (`"population": 2111323233333…`), now ends its JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.sampling_params import StructuredOutputsParams as Spec
from blockserve.structured import GrammarCompiler, GrammarLimits, JsonBounds
from blockserve.structured.json_bounds import ANY_VALUE, bounded_schema

VOCAB = 49152
EOS = 2
REF = {"$ref": f"#/$defs/{ANY_VALUE}"}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, VOCAB, EOS)


@pytest.fixture(scope="module")
def bundled_model():
    """The bundled SmolLM2, loaded once for the engines below."""
    return load_model(None, BACKENDS["exact"])


def accepts(compiler: GrammarCompiler, tokenizer, spec: Spec, text: str) -> bool:
    """Whether the grammar of `spec` takes `text` whole and complete."""
    matcher = compiler.compile(spec).start_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_rewrite_adds_the_missing_bounds_and_keeps_the_schemas_own():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "own": {"type": "integer", "maximum": 10 ** 20},
        "step": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0}, "free": {},
        "list": {"type": "array"}, "choice": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "not_int": {"not": {"type": "integer"}}},
        "$defs": {"d": {"type": "number"}}, "additionalProperties": False}
    bounded = bounded_schema(schema, JsonBounds())
    props = bounded["properties"]
    assert props["n"] == {"type": "integer", "maximum": 10 ** 16 - 1, "minimum": -(10 ** 16 - 1)}
    assert props["x"] == {"type": ["number", "null"], "exclusiveMaximum": 10 ** 16, "exclusiveMinimum": -10 ** 16,
                          "multipleOf": 1e-10}
    assert props["own"] == {"type": "integer", "maximum": 10 ** 20, "minimum": -(10 ** 16 - 1)}
    assert props["step"] == {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0,
                             "exclusiveMaximum": 10 ** 16}
    assert props["free"] == REF and props["list"] == {"type": "array", "items": REF}
    assert props["choice"]["anyOf"][0]["maximum"] == 10 ** 16 - 1
    assert props["not_int"] == {"not": {"type": "integer"}}  # a bound inside `not` would invert it
    assert bounded["$defs"]["d"]["multipleOf"] == 1e-10 and bounded["additionalProperties"] is False
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is left alone
    assert bounded_schema(True, JsonBounds()) == {**REF, "$defs": {ANY_VALUE: bounded["$defs"][ANY_VALUE]}}
    assert bounded_schema(False, JsonBounds()) is False
    assert bounded_schema({"type": "object"}, JsonBounds())["additionalProperties"] == REF


@pytest.mark.parametrize("spec, within, past", [
    # (10^16 itself passes too: llguidance compares bounds as float64, where 10^16 - 1 rounds to 10^16)
    (Spec(json={"type": "integer"}), ["9" * 16, "-" + "9" * 16, "0", "-7"], ["1" * 17, "-" + "1" * 17, "2" * 40]),
    (Spec(json={"type": "number"}), ["9" * 16 + ".5", "0." + "1" * 10, "-3.25", "12"],
     ["1" * 17, "0." + "1" * 11, "8." + "1" * 40, "1e400"]),
    (Spec(json={"type": "object", "properties": {"p": {"type": "number"}}, "required": ["p"],
                "additionalProperties": False}), ['{"p": 1.5}'], ['{"p": ' + "2" * 30 + "}"]),
    (Spec(json_object=True), ['{"a": [1, 2.5, {"b": -3}], "c": "x"}'],
     ['{"a": ' + "1" * 17 + "}", '{"a": [1, ' + "1" * 17 + "]}", '{"a": {"b": 0.' + "3" * 11 + "}}",
      '{"a": 1,\n\n\n"b": 2}', '{"a":' + " " * 30 + "1}"]),  # no free whitespace either
    (Spec(json={}), ["[1, 2]", '"x"', "null"], ["1" * 17]),
    (Spec(json={"type": "integer", "maximum": 10 ** 18}), ["1" * 18], ["1" * 19]),  # the schema's own bound
    (Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "x-guidance": {"whitespace_flexible": True}}),
     ['{"a":  1}', '{ "a" : \n  1 }', '{"a":' + " " * 20 + "1}"], ['{"a":' + " " * 22 + "1}"]),
])
def test_the_grammar_takes_values_within_the_bounds_and_refuses_those_past_them(
        compiler, smollm2_tokenizer, spec, within, past):
    for text in within:
        assert accepts(compiler, smollm2_tokenizer, spec, text), text
    for text in past:
        assert not accepts(compiler, smollm2_tokenizer, spec, text), text


def test_the_bounds_are_configurable(smollm2_tokenizer):
    narrow = GrammarCompiler(smollm2_tokenizer, VOCAB, EOS,
                             GrammarLimits(json_bounds=JsonBounds(max_integer_digits=4, max_fraction_digits=2)))
    number = Spec(json={"type": "number"})
    assert accepts(narrow, smollm2_tokenizer, number, "9999.99")
    for text in ("10000", "1.001"):
        assert not accepts(narrow, smollm2_tokenizer, number, text)
    with pytest.raises(ValueError, match="max_fraction_digits"):
        JsonBounds(max_fraction_digits=11)  # llguidance's finest multipleOf is 1e-10
    with pytest.raises(ValueError, match="max_integer_digits"):
        JsonBounds(max_integer_digits=0)
    with pytest.raises(ValueError, match="max_integer_digits"):
        JsonBounds(max_integer_digits=19)  # llguidance's integer bounds are 64-bit


@pytest.mark.slow  # the real model
def test_an_engine_built_with_narrower_bounds_holds_its_outputs_to_them(bundled_model):
    """`LLM(..., json_max_integer_digits=3)` (`--json-max-integer-digits 3` on the command line):
    the engine's grammars, and so its outputs, keep every integer under 1000."""
    llm = LLM(bundled_model, max_model_len=256, json_max_integer_digits=3)
    assert llm.engine.grammars.limits.json_bounds == JsonBounds(max_integer_digits=3)
    schema = {"type": "object", "properties": {"year": {"type": "integer"}, "population": {"type": "integer"}},
              "required": ["year", "population"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=Spec(json=schema))
    (output,) = llm.chat([[{"role": "user", "content": "Give statistics about the world population."}]], params,
                         use_tqdm=False)
    answer = json.loads(output.outputs[0].text)
    assert all(abs(v) < 1000 for v in answer.values()), answer
    llm.close()


CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population_millions": {"type": "number"}},
        "required": ["name", "country", "population_millions"], "additionalProperties": False}
STATS = {"type": "object", "properties": {"year": {"type": "integer"}, "population": {"type": "integer"}},
         "required": ["year", "population"], "additionalProperties": False}
OPEN_PROMPTS = ["Describe the largest city in the world.", "Tell me something.",
                "Give statistics about the world population.", "Describe China's population",
                "How many people live in India?"]
MAX_TOKENS = 100


@pytest.mark.slow  # the real model
def test_open_prompts_under_strict_schemas_end_their_json_on_the_bundled_model(bundled_model):
    """Before the bounds, 7 of these 10 ran a number on to max_tokens (`1.2288888…`, `1111…`)."""
    llm = LLM(bundled_model, max_model_len=512)
    conversations = [[{"role": "user", "content": q}] for q in OPEN_PROMPTS]
    for schema in (CITY, STATS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=schema))
        for output in llm.chat(conversations, params, use_tqdm=False):
            out = output.outputs[0]
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


def test_forced_tool_calls_in_hermes_blocks_bound_their_arguments_numbers(compiler, smollm2_tokenizer):
    from blockserve.server.protocol import ChatCompletionRequest
    from blockserve.server.tools.envelope import tool_setup
    from blockserve.server.tools.hermes import hermes_grammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
                                                 "tool_choice": "required"})
    spec = hermes_grammar(tool_setup(body))

    def call(n: str) -> str:
        return '<tool_call>\n{"name": "f", "arguments": {"n": ' + n + "}}\n</tool_call>"

    assert accepts(compiler, smollm2_tokenizer, spec, call("9" * 16))
    assert not accepts(compiler, smollm2_tokenizer, spec, call("1" * 17))


@pytest.mark.parametrize("schema", [{"type": {"a": 1}}, {"type": [["integer"]]}, {"$defs": 5}, {"properties": 5},
                                    {"items": 5}, {"anyOf": 5}, {"type": "object", "properties": {"a": 5}},
                                    {"type": "integer", "maximum": "big"}])
def test_a_malformed_schema_is_refused_with_a_reason_never_an_error(compiler, schema):
    from blockserve.errors import InvalidRequest

    try:
        compiler.compile(Spec(json=schema))
    except InvalidRequest as e:
        assert "structured_outputs.json" in str(e)
