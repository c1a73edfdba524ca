"""GrammarCompiler on the bundled SmolLM2 tokenizer: each kind compiles, the cache returns the
same grammar, a bad spec is an InvalidRequest with llguidance's reason, the time cap holds, and a
matcher replays output tokens (re-admission after preemption) to the same state."""

from __future__ import annotations

import json

import pytest
import torch

from blockserve.errors import InvalidRequest
from blockserve.sampling_params import StructuredOutputsParams as Spec
from blockserve.structured import GrammarCompiler, GrammarLimits, GrammarMatcher

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, VOCAB, EOS)


def allowed_ids(matcher: GrammarMatcher) -> list[int]:
    bitmask = torch.zeros(matcher.num_words, dtype=torch.int32)
    matcher.fill_bitmask(bitmask)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1).nonzero().view(-1).tolist()


def walk(compiler, tokenizer, spec: Spec, text: str) -> GrammarMatcher:
    """Feed `text`'s tokens through a matcher, checking each was allowed; returns the matcher."""
    matcher = GrammarMatcher(compiler.compile(spec))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in allowed_ids(matcher), f"{tokenizer.decode([token])!r} refused in {text!r}"
        matcher.accept(token)
    return matcher


@pytest.mark.parametrize("spec, text", [
    (Spec(json={"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {
        "enum": ["a", "b"]}}}, "required": ["n", "tags"], "additionalProperties": False}), '{"n": 42, "tags": ["b", "a"]}'),
    (Spec(json_object=True), '{"anything": [1, 2, {"x": null}]}'),
    (Spec(regex=r"[0-9]{3}-[A-Z]+"), "123-ABC"),
    (Spec(choice=["red", "green", "dark blue"]), "dark blue"),
    (Spec(grammar='start: "yes" | "no" " way"'), "no way"),  # Lark
    (Spec(grammar='root ::= ("ab" | "cd")+ "!"'), "abcdab!"),  # GBNF
])
def test_each_kind_compiles_and_forces_eos_at_its_end(compiler, smollm2_tokenizer, spec, text):
    matcher = walk(compiler, smollm2_tokenizer, spec, text)
    allowed = allowed_ids(matcher)
    if spec.kind in ("json", "json_object", "choice", "grammar"):
        assert allowed == [EOS]  # complete: only EOS may follow
    else:
        assert EOS in allowed and len(allowed) > 1  # a regex's [A-Z]+ may go on


def test_json_is_one_line_with_its_separators(compiler, smollm2_tokenizer):
    spec = Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    matcher = GrammarMatcher(compiler.compile(spec))
    matcher.accept(smollm2_tokenizer.encode("{", add_special_tokens=False)[0])
    newline = smollm2_tokenizer.encode("\n", add_special_tokens=False)[0]
    assert newline not in allowed_ids(matcher)


def test_the_cache_returns_the_compiled_grammar(compiler):
    a = compiler.compile(Spec(regex="x+y"))
    assert compiler.compile(Spec(regex="x+y")) is a
    assert compiler.compile(Spec(regex="x+z")) is not a


@pytest.mark.parametrize("spec, reason", [
    (Spec(regex="(unclosed"), "unclosed group"),
    (Spec(json={"type": "strng"}), "strng"),
    (Spec(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
    (Spec(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_a_bad_spec_is_an_invalid_request_with_the_reason(compiler, spec, reason):
    with pytest.raises(InvalidRequest, match=reason) as e:
        compiler.compile(spec)
    assert f"structured_outputs.{spec.kind}" in str(e.value)
    assert e.value.param == spec.kind


def test_the_compile_time_cap(smollm2_tokenizer):
    slow = GrammarCompiler(smollm2_tokenizer, VOCAB, EOS, GrammarLimits(compile_timeout_s=1e-9))
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i},{i + 9}}}"}
                                               for i in range(40)}}
    with pytest.raises(InvalidRequest, match="took longer than 1e-09 s; simplify it"):
        slow.compile(Spec(json=schema))


def test_the_size_cap(smollm2_tokenizer):
    small = GrammarCompiler(smollm2_tokenizer, VOCAB, EOS, GrammarLimits(max_grammar_size=50))
    schema = {"type": "object", "properties": {f"key{i}": {"type": "integer"} for i in range(100)}}
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        small.compile(Spec(json=schema))


def test_replaying_output_tokens_reaches_the_same_state(compiler, smollm2_tokenizer):
    spec = Spec(json={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    text = '{"city": "Par'
    live = walk(compiler, smollm2_tokenizer, spec, text)
    replayed = GrammarMatcher(compiler.compile(spec), smollm2_tokenizer.encode(text, add_special_tokens=False))
    assert allowed_ids(replayed) == allowed_ids(live)
    assert replayed.num_accepted == live.num_accepted


def test_a_refused_token_leaves_only_eos(compiler, smollm2_tokenizer):
    matcher = GrammarMatcher(compiler.compile(Spec(choice=["yes", "no"])))
    matcher.accept(smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert allowed_ids(matcher) == [EOS]


def test_no_tokenizer_no_grammar():
    with pytest.raises(InvalidRequest, match="need the model's tokenizer"):
        GrammarCompiler(None, VOCAB, EOS).compile(Spec(regex="a"))


def test_schema_text_and_dict_share_a_cache_entry(compiler):
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}}
    assert compiler.compile(Spec(json=schema)) is compiler.compile(Spec(json=json.dumps(schema)))
