"""Structured outputs with speculation, through the whole engine on a tiny random Llama that carries
SmolLM2's tokenizer: greedy JSON-schema and regex outputs identical with and without drafts (n-gram,
suffix, draft model); a proposer that drafts grammar-refused tokens never gets one into the output,
whether the scheduler cuts them or the worker's masks reject them; after every verification the
worker's grammar is exactly the accepted prefix's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.models.random_checkpoint import save_random_model
from blockserve.sampling_params import StructuredOutputsParams as Spec
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.speculator import Speculator
from blockserve.spec_decode.step_costs import FlatStepCosts
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker import model_runner
from tests.engine.test_tiny_engine import SIZES

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 6}},
          "required": ["name", "tags"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [0-9]{2}:[0-9]{2})?"
PROMPTS = ['Give {"name": "x", "tags": ["a", "b", "a"]} again as JSON.', "The dates 2024-05-01 and 2024-05-02, then",
           'A person: {"name": "ab", "tags": []}. Another:', "When? 1999-12-31 23:59 or"]
SPECS = [Spec(json=json.dumps(PERSON)), Spec(regex=DATE), Spec(json=json.dumps(PERSON)), Spec(regex=DATE)]
OPTIONS = dict(block_size=4, kv_cache_memory="4MiB", max_model_len=128, check_integrity=True, poison=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_tokenizer):
    return smollm2_gguf_tokenizer  # transformers' (saved beside the tiny model below)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary, with its tokenizer (so grammars compile)."""
    path = tmp_path_factory.mktemp("tiny-structured")
    sizes = SIZES | {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    save_random_model(LlamaConfig(**sizes), path, seed=3)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified, whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


@pytest.fixture
def checked_grammars(monkeypatch):
    """After every verification, each constrained request's grammar in the worker equals a fresh
    matcher fed the request's output: the state after the accepted prefix, never a rejected draft's."""
    verify = model_runner.LaunchedStep._verify
    seen = []

    def checking(step, host, sampled, logprobs):
        verify(step, host, sampled, logprobs)
        for request in step.requests:
            if request.grammar is not None:
                fresh = GrammarMatcher(request.grammar.compiled, request.output_token_ids)
                assert request.grammar.num_accepted == len(request.output_token_ids)
                assert _mask(request.grammar) == _mask(fresh)
                seen.append(len(request.output_token_ids))

    monkeypatch.setattr(model_runner.LaunchedStep, "_verify", checking)
    return seen


def _mask(matcher: GrammarMatcher) -> list[int]:
    row = torch.empty(matcher.num_words, dtype=torch.int32)
    matcher.fill_bitmask(row)
    return row.tolist()


def params(max_tokens: int = 24) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=s) for s in SPECS]


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny):
    out = outputs(LLM(tiny, **OPTIONS))
    assert all(len(o) > 3 for o in out)
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_greedy_structured_outputs_are_identical_with_speculation(tiny, plain, method, checked_grammars):
    spec = {"ngram": NGRAM, "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3}}[method]
    llm = LLM(tiny, speculative_config=spec, **OPTIONS)
    assert outputs(llm) == plain
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert checked_grammars  # verifications of constrained requests happened


class _Oracle:
    """Drafts a request's plain greedy continuation, with one token the grammar refuses ("\\n": no
    JSON layout here nor the date regex allows it) at a position that moves from step to step."""

    def __init__(self, prompts: list[list[int]], plain: list[list[int]], bad: int):
        self.prompts, self.plain, self.bad = prompts, plain, bad
        self.bad_drafted = 0

    def propose(self, request_id, token_ids, max_tokens):
        i = next(i for i, p in enumerate(self.prompts) if list(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(self.prompts[i])
        drafts = list(self.plain[i][done:done + max_tokens])
        where = done % 4
        if where < len(drafts):
            drafts[where] = self.bad
            self.bad_drafted += 1
        return drafts

    def forget(self, request_id):
        pass

    num_requests = 0


@pytest.mark.parametrize("scheduler_cut", [True, False], ids=["scheduler-cut", "worker-masks-only"])
def test_grammar_refused_drafts_never_reach_the_output(tiny, plain, tokenizer, monkeypatch, checked_grammars,
                                                       scheduler_cut):
    bad = tokenizer.encode("\n", add_special_tokens=False)
    assert len(bad) == 1
    oracle = _Oracle([tokenizer.encode(p) for p in PROMPTS], plain, bad[0])
    monkeypatch.setattr(speculator_module, "make_proposer", lambda config: oracle)
    if not scheduler_cut:  # the worker sees every refused draft
        monkeypatch.setattr(Speculator, "_grammar_cut", lambda self, rid, drafts, grammar, output: drafts)
    llm = LLM(tiny, speculative_config=NGRAM, **OPTIONS)
    out = outputs(llm)
    assert out == plain
    assert all(bad[0] not in o for o in out)
    stats = llm.engine.stats().speculation
    assert oracle.bad_drafted > 0 and stats.num_accepted_tokens > 0
    if scheduler_cut:  # drafts stop before the refused one: every drafted token is the plain one
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert checked_grammars


def test_a_draft_model_drafts_under_the_grammar(tiny, plain, tokenizer, tmp_path, checked_grammars):
    """A random draft model (another seed) drafts tokens the grammars refuse when left to itself; under
    the request's grammar every draft it proposes is allowed after the output and the drafts before it
    (up to an EOS the grammar allows), and the outputs are those of a run without drafts. The target as
    its own draft then drafts exactly its constrained tokens: nearly all accepted, runs of k."""
    draft = tmp_path / "draft"
    save_random_model(LlamaConfig(**SIZES | {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}),
                      draft, seed=11)
    tokenizer.save_pretrained(draft)
    llm = LLM(tiny, speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
              **OPTIONS)
    proposer = llm.engine.core.scheduler.speculator.proposer
    proposed, propose_batch = [], proposer.propose_batch

    def recording(asks):  # each ask's tokens as they were (the request's list grows), the drafts before handed out
        drafts = propose_batch(asks)
        proposed.append(([(rid, list(token_ids), k, sampling) for rid, token_ids, k, sampling in asks], dict(drafts)))
        return drafts

    proposer.propose_batch = recording
    assert outputs(llm) == plain
    asks = [(ask, drafts[ask[0]]) for batch, drafts in proposed for ask in batch if drafts.get(ask[0])]
    assert len(asks) > len(PROMPTS)
    for (rid, token_ids, k, sampling), drafts in asks:
        assert _allowed_in_a_row(sampling.params.structured_outputs.compiled, token_ids[sampling.num_prompt_tokens:],
                                 drafts)
    refused_when_free = 0
    for (rid, token_ids, k, sampling), drafts in asks[:len(PROMPTS) * 2]:  # the first ones (each feeds its prompt)
        output = token_ids[sampling.num_prompt_tokens:]
        free = dataclasses.replace(sampling, params=dataclasses.replace(sampling.params, structured_outputs=None))
        free_drafts = propose_batch([("free", token_ids, k, free)])["free"]
        proposer.forget("free")
        refused_when_free += not _allowed_in_a_row(sampling.params.structured_outputs.compiled, output, free_drafts)
    assert refused_when_free > len(PROMPTS)
    assert proposer.num_requests == 0

    itself = LLM(tiny, speculative_config={"method": "draft_model", "model": tiny, "num_speculative_tokens": 3},
                 **OPTIONS)
    assert outputs(itself) == plain
    stats = itself.engine.stats().speculation
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert stats.mean_accepted_length > 3


def _allowed_in_a_row(compiled, output: list[int], drafts: list[int]) -> bool:
    """Whether the grammar's mask allows each draft after the output and the drafts before it."""
    masks = GrammarMatcher(compiled, output).draft_masks(drafts)
    return all(mask.allows(draft) for mask, draft in zip(masks, drafts))
