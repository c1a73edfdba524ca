"""StructuredOutputsParams and logit_bias are validated once, at construction."""

import pytest

from blockserve.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar or json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "string"}, regex="a+")
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


def test_json_schema_is_kept_as_text_and_compared_by_value():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a.json == b.json and a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="must be a JSON schema"):
        StructuredOutputsParams(json="[1, 2]")


def test_choice_and_strings():
    assert StructuredOutputsParams(choice=["yes", "no"]).choice == ("yes", "no")
    for bad in ([], "yes", ["yes", 3]):
        with pytest.raises(ValueError, match="choice"):
            StructuredOutputsParams(choice=bad)
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")


def test_the_compiled_grammar_is_not_part_of_equality():
    assert StructuredOutputsParams(regex="a", compiled=object()) == StructuredOutputsParams(regex="a")


def test_sampling_params_refuse_ignore_eos_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_logit_bias_is_normalised_and_bounded():
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    assert SamplingParams(logit_bias={}).logit_bias == ()
    for bad in ({1: 100.5}, {1: -101}, {1: float("nan")}):
        with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="non-negative token ids"):
        SamplingParams(logit_bias={-1: 1})
