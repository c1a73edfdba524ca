"""Draft-model speculation through the whole engine: a draft equal to the target has its drafts
accepted, a random draft leaves the greedy tokens as they are (prefix caching, chunked prefill,
preemption, poison, abort), the draft's cache rolls back to the drafts the target kept and frees
every block, and drafts that cannot serve the target are refused at start-up, naming the field."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig

from blockserve import LLM, SamplingParams
from blockserve.kv.specs import SlidingWindowSpec
from blockserve.models.random_checkpoint import save_random_model
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.spec_decode.step_costs import FlatStepCosts
from tests.engine.test_speculative_engine import NEW_TOKENS, prompts
from tests.engine.test_tiny_engine import SIZES, SMALL_CACHE

OPTIONS = dict(block_size=4, kv_cache_memory="4MiB", check_integrity=True, poison=True)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
DRAFT_SIZES = SIZES | dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, a smaller random draft of the same vocabulary), saved."""
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_random_model(LlamaConfig(**SIZES), target)
    save_random_model(LlamaConfig(**DRAFT_SIZES), draft, seed=5)
    return str(target), str(draft)


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified, whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


def spec(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def assert_nothing_held(llm: LLM) -> None:
    proposer = llm.engine.core.scheduler.speculator.proposer
    assert proposer.num_requests == 0
    assert proposer.kv.usage() == [0.0] * len(proposer.kv.config.groups)
    assert not proposer.runner.batch.requests
    llm.engine.core.scheduler.assert_idle()


def first_feeds(llm: LLM) -> dict[str, int]:
    """Per request, how many tokens the draft's runner is fed in its first forward for it (filled as the
    engine runs)."""
    runner, feeds = llm.engine.core.scheduler.speculator.proposer.runner, {}
    execute = runner.execute

    def record(out):
        for rid, ids in out.scheduled_token_ids.items():
            feeds.setdefault(rid, len(ids))
        return execute(out)

    runner.execute = record
    return feeds


def test_a_draft_equal_to_the_target_has_its_drafts_accepted(models):
    """...and a repeated prompt's draft blocks come from the draft's prefix cache: its first forward
    feeds only the tokens past the last whole cached block, never the blocks the hit holds."""
    target, _ = models
    plain = tokens(LLM(target, **OPTIONS))
    llm = LLM(target, speculative_config=spec(target), **OPTIONS)
    feeds = first_feeds(llm)
    assert tokens(llm) == plain
    assert max(feeds.values()) > OPTIONS["block_size"]  # the prompts fed whole
    draft_hits = llm.engine.core.scheduler.speculator.proposer.kv.prefix_cache_stats().hits
    feeds.clear()
    assert tokens(llm) == plain  # the target's prompts from its prefix cache, and the draft's from its own
    assert llm.engine.core.scheduler.speculator.proposer.kv.prefix_cache_stats().hits > draft_hits
    assert len(feeds) == len(prompts()) and max(feeds.values()) <= OPTIONS["block_size"]
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(prompts())
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert_nothing_held(llm)


@pytest.mark.parametrize("scenario", [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 8}, SMALL_CACHE],
                         ids=["prefix-caching", "no-prefix-caching", "chunked", "preemption"])
def test_a_random_draft_keeps_the_greedy_tokens(models, scenario):
    """The tokens of a run without the draft, the draft's forwards batched across a step's requests; a
    preempted request gives its draft blocks back with the target's."""
    target, draft = models
    options = OPTIONS | scenario
    plain = tokens(LLM(target, **options))
    llm = LLM(target, speculative_config=spec(draft, 4), **options)
    speculator = llm.engine.core.scheduler.speculator
    runner, preempted = speculator.proposer.runner, speculator.preempted
    execute, batch_sizes, draft_rows = runner.execute, [], []  # draft_rows: (before, after) each preemption
    runner.execute = lambda out: batch_sizes.append(len(out.num_scheduled_tokens)) or execute(out)
    rows = speculator.proposer.num_cached_rows
    speculator.preempted = lambda rid: draft_rows.append((rows(rid), preempted(rid) or rows(rid)))
    assert tokens(llm) == plain
    assert max(batch_sizes) > 1  # the step's requests draft in one batch
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    if scenario is SMALL_CACHE:
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert any(before for before, _ in draft_rows) and all(after == 0 for _, after in draft_rows)
    assert_nothing_held(llm)


def test_an_aborted_request_gives_its_draft_blocks_back(models):
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), **OPTIONS)
    engine = llm.engine
    for i, prompt in enumerate(prompts()[:3]):
        engine.add_request(str(i), prompt, GREEDY)
    for _ in range(4):
        engine.step()
    proposer = engine.core.scheduler.speculator.proposer
    assert proposer.num_requests == 3 and max(proposer.kv.usage()) > 0
    engine.abort_request(["1"])
    assert proposer.num_requests == 2 and proposer.kv.pending_is_empty()  # its blocks poisoned at once
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] = list(output.outputs[0].token_ids)  # cumulative
    assert_nothing_held(llm)
    plain = tokens(LLM(target, **OPTIONS))
    assert got == {"0": plain[0], "2": plain[2]}


def test_the_draft_cache_keeps_only_the_drafts_the_target_kept(models, monkeypatch):
    """After a rejection the draft feeds only the tokens past the last draft the target kept, and
    proposes what a draft fed the same tokens from scratch proposes."""
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), **OPTIONS)
    proposer = llm.engine.core.scheduler.speculator.proposer
    fed = []
    execute = proposer.runner.execute
    monkeypatch.setattr(proposer.runner, "execute", lambda out: fed.append(out.scheduled_token_ids) or execute(out))
    prompt = prompts()[2]
    first = proposer.propose("a", prompt, 3)
    assert [ids["a"] for ids in fed if ids] == [prompt, first[:1], first[1:2]]
    wrong = (first[1] + 1) % SIZES["vocab_size"]
    # The target kept the first draft, emitted its own token, and two more in steps without drafts.
    kept = prompt + [first[0], wrong, 7, 8]
    fed.clear()
    again = proposer.propose("a", kept, 3)
    assert [ids["a"] for ids in fed if ids][0] == [wrong, 7, 8]
    assert proposer.num_cached_rows("a") == len(kept) + 2  # kept, and the drafts fed back but the last
    assert proposer.propose("b", kept, 3) == again
    proposer.forget("a")
    proposer.forget("b")
    assert_nothing_held(llm)


def test_the_draft_s_prefix_cache_is_keyed_by_the_request_s_salt(models):
    """A prompt's draft blocks are hit by a later request of the same cache_salt, never another's (C6)."""
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), **OPTIONS)
    proposer = llm.engine.core.scheduler.speculator.proposer
    prompt = prompts()[2]

    def propose(request_id: str, salt: str) -> list[int]:
        return proposer.propose(request_id, prompt, 3, DraftSampling(GREEDY, len(prompt), cache_salt=salt))

    first = propose("a", "tenant-1")
    assert propose("b", "tenant-2") == first and proposer.kv.prefix_cache_stats().hits == 0
    assert propose("c", "tenant-1") == first
    assert proposer.kv.prefix_cache_stats().hits == (len(prompt) - 1) // 4 * 4  # whole blocks, one token left
    for request_id in "abc":
        proposer.forget(request_id)
    assert_nothing_held(llm)


def test_sampled_requests_are_reproducible_with_a_draft(models):
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), **OPTIONS)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, seed=3, logprobs=1, ignore_eos=True)
    first = llm.generate(prompts()[:2], params, use_tqdm=False)
    again = llm.generate(prompts()[:2], params, use_tqdm=False)
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].token_ids) == len(a.outputs[0].logprobs) == NEW_TOKENS
    assert llm.engine.stats().speculation.num_draft_tokens > 0


def test_the_draft_runner_draws_from_another_stream_than_the_target(models):
    """Unseeded requests share their runner's generator: with the engine's seed given to both runners,
    a draft would be drawn with the very numbers that verify the target's earlier rows, which makes
    rejection sampling's tokens correlated across steps. The draft's runner takes a derived seed."""
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), seed=0, **OPTIONS)
    drafting = llm.engine.core.scheduler.speculator.proposer.runner.sampler.generator
    assert drafting.initial_seed() != llm.engine.core.runner.sampler.generator.initial_seed()


def test_sampled_drafts_from_the_target_itself_are_accepted_with_the_target_logprobs(models):
    """At temperature 0.8 the target as its own draft samples q = p (up to rounding), so rejection sampling
    accepts nearly every draft (comparing the target's own sample with a draft would accept about
    sum p^2 of them); the logprobs of the emitted tokens are the target's, as a plain run scores them."""
    target, _ = models
    llm = LLM(target, speculative_config=spec(target), **OPTIONS)
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=NEW_TOKENS, seed=5, logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(prompts())
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outputs]
    assert_nothing_held(llm)
    scorer = LLM(target, **OPTIONS)
    for prompt, output in zip(prompts(), outputs):
        ids = output.outputs[0].token_ids
        scored = scorer.generate([prompt + ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        for token, entry, reference in zip(ids, output.outputs[0].logprobs, scored[0].prompt_logprobs[len(prompt):]):
            assert entry[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)


def test_drafts_that_cannot_serve_the_target_are_refused(models, tmp_path):
    target, _ = models
    other_vocab = tmp_path / "vocab"
    save_random_model(LlamaConfig(**DRAFT_SIZES | {"vocab_size": 256}), other_vocab)
    short = tmp_path / "short"
    save_random_model(LlamaConfig(**DRAFT_SIZES | {"max_position_embeddings": 32}), short)
    for draft, message in [(other_vocab, "vocabulary has 256 tokens, the target's 512"),
                           (tmp_path / "missing", "does not load"), (short, "holds 32 positions")]:
        with pytest.raises(ValueError, match=f"speculative_config.model.*{message}"):
            LLM(target, speculative_config=spec(str(draft)), max_model_len=128, kv_cache_memory="4MiB")


def test_the_draft_s_blocks_are_allocated_with_the_target_s(models):
    """The draft's groups are the companion of the target's manager: after every step each request holds
    draft blocks for at least the positions it holds target blocks for, so a request whose draft blocks
    do not fit is not admitted (or preempts another, freeing both models' blocks)."""
    target, draft = models
    options = OPTIONS | SMALL_CACHE  # each cache holds about 100 tokens
    long_prompts = [[(7 * i + offset) % 500 for i in range(40)] for offset in (1, 2, 3)]
    plain = [o.outputs[0].token_ids for o in LLM(target, **options).generate(long_prompts, GREEDY, use_tqdm=False)]
    llm = LLM(target, speculative_config=spec(draft, 4), **options)
    engine, kv = llm.engine, llm.engine.core.kv
    for i, prompt in enumerate(long_prompts):
        engine.add_request(str(i), prompt, GREEDY)
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        tables = kv.coordinator.managers[0].req_blocks
        draft_tables = kv.companion.coordinator.managers[0].req_blocks
        assert set(draft_tables) == set(tables), f"step {steps}"
        assert all(len(draft_tables[rid]) >= len(blocks) for rid, blocks in tables.items()), f"step {steps}"
    assert [got[str(i)] for i in range(3)] == plain
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.stats().speculation.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_a_sliding_window_draft_allocates_on_its_own_and_keeps_the_greedy_tokens(models, tmp_path):
    """A draft with sliding-window layers feeds behind the target, so its windows' blocks cannot follow the
    target's allocations: its cache is its own (no companion), and the greedy tokens stay the target's."""
    target, _ = models
    window_draft = tmp_path / "window"
    save_random_model(MistralConfig(**DRAFT_SIZES, sliding_window=6), window_draft, seed=7)
    llm = LLM(target, speculative_config=spec(str(window_draft)), **OPTIONS)
    draft_groups = llm.engine.core.scheduler.speculator.proposer.kv.config.groups
    assert any(isinstance(g.spec, SlidingWindowSpec) for g in draft_groups) and llm.engine.core.kv.companion is None
    assert tokens(llm) == tokens(LLM(target, **OPTIONS))
    assert llm.engine.stats().speculation.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_the_draft_s_kv_cache_is_drawn_from_the_target_s_budget(models):
    """One budget holds both caches, each as many tokens; one that holds only the target's is refused."""
    target, draft = models
    core = LLM(target, speculative_config=spec(draft), **OPTIONS).engine.core
    caches = (core.kv_config, core.scheduler.speculator.proposer.kv.config)
    assert sum(g.num_slots * g.bytes_per_block for c in caches for g in c.groups) <= 4 * 2**20
    assert [c.groups[0].num_blocks for c in caches] == [caches[0].groups[0].num_blocks] * 2
    assert caches[0].groups[0].num_blocks < LLM(target, **OPTIONS).engine.core.kv_config.groups[0].num_blocks
    just_the_target = (64 // 4 + 1) * caches[0].groups[0].bytes_per_block  # 16 blocks and the null block
    LLM(target, block_size=4, max_model_len=64, kv_cache_memory=just_the_target)
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's KV cache is drawn from the "
                                         "target's budget: .* cannot hold even one request"):
        LLM(target, speculative_config=spec(draft), block_size=4, max_model_len=64, kv_cache_memory=just_the_target)


def test_the_draft_s_cache_books_are_checked_after_every_step(models):
    """C3 over the draft's own cache too: a block held by no request (planted) fails the next step."""
    target, draft = models
    llm = LLM(target, speculative_config=spec(draft), **OPTIONS)
    pool = llm.engine.core.scheduler.speculator.proposer.kv.coordinator.pools[0]
    pool.get_new_blocks(1)
    with pytest.raises(AssertionError, match="has ref_cnt 1 but 0 holders"):
        tokens(llm)
