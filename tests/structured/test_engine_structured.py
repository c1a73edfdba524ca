"""Structured outputs through the offline API on the bundled SmolLM2 (greedy): a batch mixing
JSON-schema, regex, choice and grammar rows with unconstrained ones; the constrained outputs
obey their grammar and end with EOS ("stop"); the unconstrained rows get exactly the tokens they
get alone; preemption (recompute), async scheduling and speculation give the same outputs; abort and finish leave nothing behind;
min_tokens yields to the grammar; a bad schema is refused and the engine goes on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.errors import InvalidRequest
from blockserve.models.loader import load_model
from blockserve.sampling_params import StructuredOutputsParams as Spec
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts

pytestmark = pytest.mark.slow  # the real model through the engine

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "sky": {"enum": ["sunny", "rainy", "cloudy"]},
    "temps": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "sky", "temps"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
COLOURS = ["red", "green", "blue"]
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
MAX_TOKENS = 40

CASES = [  # (question, constraint or None)
    ("Describe a person as JSON with a name and an age.", Spec(json=PERSON)),
    ("What is the capital of France?", None),
    ("Describe the weather in Paris as JSON.", Spec(json=WEATHER)),
    ("Name three primary colors.", None),
    ("When did the first person walk on the moon? Give the date.", Spec(regex=DATE)),
    ("Why is the sky blue?", None),
    ("What colour is the sky on a clear day?", Spec(choice=COLOURS)),
    ("Write a haiku about autumn.", None),
    ("Is water wet?", Spec(grammar=GRAMMAR)),
    ("Describe a teacher as JSON.", Spec(json=PERSON)),
]


def check(spec: Spec, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif spec.kind == "choice":
        assert text in spec.choice
    else:
        assert re.fullmatch(r"The answer is (yes|no)\.", text), text


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, BACKENDS["exact"])


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, max_model_len=512, check_integrity=True)


def params(spec: Spec | None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec, **extra)


def conversations():
    return [[{"role": "user", "content": q}] for q, _ in CASES]


@pytest.fixture(scope="module")
def mixed(llm):
    return [o.outputs[0] for o in llm.chat(conversations(), [params(s) for _, s in CASES], use_tqdm=False)]


def test_constrained_rows_obey_their_grammar_and_stop(mixed):
    for (_, spec), out in zip(CASES, mixed):
        if spec is not None:
            check(spec, out.text)
            assert out.finish_reason == "stop", (spec.kind, out.text)


def test_unconstrained_rows_get_the_tokens_they_get_alone(llm, mixed):
    plain = [(c, out) for c, (_, spec), out in zip(conversations(), CASES, mixed) if spec is None]
    alone = llm.chat([c for c, _ in plain], params(None), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [out.token_ids for _, out in plain]
    unconstrained_text = "".join(o.outputs[0].text for o in alone)
    assert "Paris" in unconstrained_text  # a sanity check that these are real answers


def test_preemption_recomputes_to_the_same_outputs(loaded, mixed):
    small = LLM(loaded, max_model_len=256, kv_cache_memory="12MiB", check_integrity=True)  # ~270 tokens; the batch needs ~800
    outs = small.chat(conversations(), [params(s) for _, s in CASES], use_tqdm=False)
    scheduler = small.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [out.token_ids for out in mixed]
    scheduler.assert_idle()
    assert small.engine.core.runner.batch.requests == {}


def test_async_scheduling_gives_the_same_outputs(loaded, mixed):
    """A grammar row's next bitmask needs its previous token, so the launch waits for it; a row that
    EOS ends computes one more token in the step already launched, which is dropped."""
    ahead = LLM(loaded, max_model_len=512, check_integrity=True, async_scheduling=True)
    outs = ahead.chat(conversations(), [params(s) for _, s in CASES], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [out.token_ids for out in mixed]
    ahead.engine.core.scheduler.assert_idle()
    assert ahead.engine.core.runner.batch.requests == {}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_gives_the_same_outputs(loaded, mixed, method, monkeypatch):
    """Constrained and unconstrained rows draft; the grammar rows verify under their per-position masks
    and come out as without drafts (the bundled model verifies in its native decode stack). Every
    draft is verified, whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    drafting = LLM(loaded, max_model_len=512, check_integrity=True, speculative_config=spec)
    outs = drafting.chat(conversations(), [params(s) for _, s in CASES], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [out.token_ids for out in mixed]
    assert drafting.engine.stats().speculation.num_accepted_tokens > 0
    drafting.engine.core.scheduler.assert_idle()


def test_min_tokens_yields_to_the_grammar(llm):
    out = llm.chat(conversations()[6], params(Spec(choice=COLOURS), min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert out.text in COLOURS and out.finish_reason == "stop"


def test_n_samples_each_obey_the_grammar(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=PERSON))
    out = llm.chat(conversations()[0], p, use_tqdm=False)[0]
    for c in out.outputs:
        check(Spec(json=PERSON), c.text)


def test_abort_frees_the_grammar_and_the_blocks(llm):
    engine = llm.engine
    prompt = llm.apply_chat_template(conversations()[0])
    engine.add_request("to-abort", prompt, params(Spec(json=PERSON)))
    engine.add_request("to-finish", prompt, params(Spec(choice=COLOURS)))
    engine.step()
    engine.step()
    runner = engine.core.runner
    assert runner.batch.requests["to-abort"].grammar is not None
    engine.abort_request(["to-abort"])
    while engine.has_unfinished_requests():
        engine.step()
    assert runner.batch.requests == {}
    engine.core.scheduler.assert_idle()


def test_a_bad_schema_is_refused_and_the_engine_goes_on(llm):
    with pytest.raises(InvalidRequest, match="structured_outputs.json cannot be compiled"):
        llm.generate("Hi", params(Spec(json={"type": "object", "properties": {"a": {"type": "nope"}}})),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hi", params(Spec(choice=["ok"])), use_tqdm=False)[0].outputs[0]
    assert out.text == "ok"
