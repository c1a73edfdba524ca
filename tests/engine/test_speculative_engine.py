"""Speculative decoding through the whole engine: the same greedy tokens as without it (batched, with
prefix caching on and off, chunked prefill, preemption and poison), seeded sampling reproducible,
acceptance statistics that add up, and models it cannot serve refused at start-up."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config

from blockserve import LLM, SamplingParams
from blockserve.models.random_checkpoint import save_random_model
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.speculator import Speculator
from blockserve.spec_decode.step_costs import FlatStepCosts
from blockserve.worker.input_batch import InputBatch
from tests.engine.test_tiny_engine import SIZES, SMALL_CACHE

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NEW_TOKENS = 24
SCENARIOS = {
    "batched": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},
    "preemption": SMALL_CACHE,
}


def prompts() -> list[list[int]]:
    """Repetitive prompts (where lookup finds drafts) and plain ones; two share a prefix."""
    loop = [7, 8, 9, 10, 11] * 4
    return [loop, [3, 4] * 6 + [5], list(range(20, 50)), loop + [1, 2], [100, 101, 102]]


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    config = LlamaConfig(**SIZES) if request.param == "llama" else Qwen2Config(**SIZES, tie_word_embeddings=True)
    save_random_model(config, path)
    return str(path)


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified (steps weighed as costing the same whatever their rows), so the tests
    see the same drafts whatever the machine's load; test_decode_steps_are_measured undoes it."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_are_identical_with_speculation(tiny, scenario):
    options = dict(block_size=4, kv_cache_memory="4MiB", check_integrity=True, poison=True) | SCENARIOS[scenario]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = tokens(LLM(tiny, **options), params)
    llm = LLM(tiny, speculative_config=SPEC, **options)
    assert tokens(llm, params) == plain
    if scenario == "batched":
        assert tokens(llm, params) == plain  # served from the prefix cache
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens <= stats.num_draft_tokens
    if scenario == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    llm.engine.core.scheduler.assert_idle()


def test_suffix_decoding_keeps_the_greedy_tokens_and_learns_across_requests(tiny):
    suffix = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
    options = dict(block_size=4, kv_cache_memory="4MiB", check_integrity=True, poison=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = tokens(LLM(tiny, **options), params)
    llm = LLM(tiny, speculative_config=suffix, **options)
    assert tokens(llm, params) == plain
    first = llm.engine.stats().speculation
    assert tokens(llm, params) == plain  # again: the finished outputs now draft too
    again = llm.engine.stats().speculation
    assert again.num_accepted_tokens - first.num_accepted_tokens > first.num_accepted_tokens > 0
    proposer = llm.engine.core.scheduler.speculator.proposer
    assert proposer.num_requests == 0 and proposer.num_cached_requests == 2 * len(prompts())
    llm.engine.core.scheduler.assert_idle()


class AlwaysWrong:
    """Drafts, after any prefix of a known greedy sequence, tokens one past the right ones: never accepted."""

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences

    def propose(self, request_id, token_ids, max_tokens):
        sequence = next(s for s in self.sequences if s[:len(token_ids)] == list(token_ids))
        return [(t + 1) % SIZES["vocab_size"] for t in sequence[len(token_ids):len(token_ids) + max_tokens]]

    def forget(self, request_id):
        pass

    num_requests = 0


def test_drafts_that_never_match_are_switched_off_and_the_tokens_kept(tiny, monkeypatch):
    """Greedy tokens unchanged, and a request whose drafts all miss verifies a few steps' drafts, then
    only the occasional one-draft probe, although every draft row is free here (flat step costs)."""
    options = dict(block_size=4, kv_cache_memory="4MiB", check_integrity=True, poison=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = tokens(LLM(tiny, **options), params)
    sequences = [p + o for p, o in zip(prompts(), plain)]
    monkeypatch.setattr(speculator_module, "make_proposer", lambda config: AlwaysWrong(sequences))
    llm = LLM(tiny, speculative_config=SPEC, **options)
    assert tokens(llm, params) == plain
    stats = llm.engine.stats().speculation
    assert stats.num_accepted_tokens == 0 and 0 < stats.num_verifications <= 8 * len(prompts())
    assert stats.num_skipped >= (NEW_TOKENS - 1 - 8) * len(prompts())
    llm.engine.core.scheduler.assert_idle()


def test_a_verification_step_attends_as_decodes_and_prompt_logprobs_keep_their_rows(tiny, monkeypatch):
    """Drafts are scored by the decode kernels: each of a request's k + 1 rows is a decode of its own
    length (what makes a verification cost close to one decode step); a prompt chunk in the same step
    keeps its own rows, so its prompt logprobs are those of a run without speculation."""
    steps = []
    prepare = InputBatch.prepare

    def recording(self, out):
        inputs = prepare(self, out)
        if out.spec_token_ids:
            steps.append((out, inputs))
        return inputs

    monkeypatch.setattr(InputBatch, "prepare", recording)
    loop, plain_prompt = prompts()[0], [60 + (7 * i) % 300 for i in range(90)]
    greedy = SamplingParams(temperature=0, max_tokens=3 * NEW_TOKENS, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm = LLM(tiny, block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=16,
              speculative_config=SPEC)
    engine = llm.engine
    engine.add_request("loop", loop, greedy)
    while not steps:  # until "loop" verifies drafts
        engine.step()
    engine.add_request("scored", plain_prompt, with_logprobs)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    mixed = [inputs for out, inputs in steps if len(out.num_scheduled_tokens) > 1]
    assert mixed, "no step verified drafts beside a prompt chunk"
    for out, inputs in steps:
        verified = [rid for rid in inputs.request_ids if rid in out.spec_token_ids]
        rows = sum(len(out.spec_token_ids[rid]) + 1 for rid in verified)
        assert inputs.layout.num_decodes >= rows
        assert inputs.layout.seq_lens[:rows] == sorted(inputs.layout.seq_lens[:rows])
        starts = dict(zip(inputs.request_ids, zip(inputs.query_start, inputs.query_start[1:])))
        assert [end - start for start, end in (starts[rid] for rid in inputs.request_ids)] == [
            out.num_scheduled_tokens[rid] for rid in inputs.request_ids]
    plain = LLM(tiny, block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=16)
    expected = plain.generate([plain_prompt], with_logprobs, use_tqdm=False)[0]
    got = next(output.prompt_logprobs for output in outputs["scored"] if output.prompt_logprobs is not None)
    assert len(got) == len(expected.prompt_logprobs)
    for a, b in zip(got, expected.prompt_logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_decode_steps_are_measured(tiny, monkeypatch):
    """The engine times its decode steps by row count (what the drafts are weighed against), and
    not its prefill steps."""
    monkeypatch.undo()
    observed = []
    observe = Speculator.observe_step
    monkeypatch.setattr(Speculator, "observe_step",
                        lambda self, rows, seconds: observed.append((rows, seconds)) or observe(self, rows, seconds))
    llm = LLM(tiny, block_size=4, kv_cache_memory="4MiB", speculative_config=SPEC)
    llm.generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats().speculation
    emitted = NEW_TOKENS - 1  # the prefill step emits the first token and is not observed
    assert len(observed) == emitted - stats.num_accepted_tokens  # every step after the prefill
    assert sum(rows for rows, _ in observed) == len(observed) + stats.num_draft_tokens
    assert all(seconds > 0 for _, seconds in observed)
    speculator = llm.engine.core.scheduler.speculator
    assert speculator.costs.seconds(1) is not None


def test_seeded_sampling_is_reproducible_and_logprobs_follow_the_tokens(tiny):
    llm = LLM(tiny, block_size=4, kv_cache_memory="4MiB", speculative_config=SPEC)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, seed=3, logprobs=2,
                            frequency_penalty=0.2, ignore_eos=True)
    first = llm.generate(prompts(), params, use_tqdm=False)
    again = llm.generate(prompts(), params, use_tqdm=False)
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids) == NEW_TOKENS
        assert all(t in entry for t, entry in zip(a.outputs[0].token_ids, a.outputs[0].logprobs))


def test_the_bundled_model_verifies_in_its_native_decode_stack(monkeypatch):
    """On GGUF blocks a verification runs the decoder stack's one native call at k + 1 rows, and the
    greedy text is the one decoded without speculation."""
    from blockserve.models import llama_decode

    stack_rows = []
    native_stack = llama_decode.native_stack
    monkeypatch.setattr(llama_decode, "native_stack", lambda layers, norm, rows: (
        stack_rows.append(rows) or native_stack(layers, norm, rows)))
    plain = LLM(max_model_len=256, kv_cache_memory="16MiB", quantized_max_rows=8)
    speculative = LLM(plain.engine.core.loaded, max_model_len=256, kv_cache_memory="16MiB", quantized_max_rows=8,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    prompt = "Monday: check the logs, update the tickets.\nTuesday: check the logs, update the tickets.\nWednesday:"
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    stack_rows.clear()
    got = speculative.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert speculative.engine.stats().speculation.num_accepted_tokens > 0
    assert 4 in stack_rows  # a step of one token and its 3 drafts, in one native call
