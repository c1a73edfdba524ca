"""Speculation with async scheduling: the greedy tokens of one step at a time without speculation
(batched with prefix caching, and under preemption, poison and the integrity checks on), drafts
accepted (n-gram lookup and a draft model), and the engine's rule that makes it exact: a step that verified drafts is settled before
the next step is scheduled (its accepted counts move every later position), while steps without
drafts run ahead, a token in flight per request."""

from __future__ import annotations

import pytest

from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.engine import core as core_module
from blockserve.engine.core import EngineCore
from blockserve.models.random_checkpoint import save_random_model
from tests.engine.test_speculative_engine import NEW_TOKENS, SPEC, flat_step_costs, prompts  # noqa: F401
from tests.engine.test_tiny_engine import SIZES, SMALL_CACHE

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
OPTIONS = dict(block_size=4, kv_cache_memory="4MiB", check_integrity=True, poison=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random Llama whose greedy outputs fall into loops n-gram lookup drafts for."""
    path = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


@pytest.fixture
def launches(monkeypatch) -> list[tuple[bool, bool]]:
    """Each launch of an async engine: (whether a step was in flight when it was launched, whether that
    step verified drafts)."""
    seen = []
    launch = EngineCore._step_ahead

    def spy(self, scheduler_output):
        previous = self._in_flight
        seen.append((previous is not None, previous is not None and bool(previous[0].spec_token_ids)))
        return launch(self, scheduler_output)

    monkeypatch.setattr(EngineCore, "_step_ahead", spy)
    return seen


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("scenario", ["batched", "preemption"])
def test_async_speculation_gives_the_plain_greedy_tokens(tiny, launches, scenario):
    options = OPTIONS | (SMALL_CACHE if scenario == "preemption" else {})
    plain = _tokens(LLM(tiny, **options))
    llm = LLM(tiny, speculative_config=SPEC, async_scheduling=True, **options)
    assert _tokens(llm) == plain
    if scenario == "batched":
        assert _tokens(llm) == plain  # from the prefix cache
    else:
        assert llm.engine.core.scheduler.num_preemptions > 0
    stats = llm.engine.stats().speculation
    assert stats.num_accepted_tokens > 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert not any(drafts for _, drafts in launches)  # never launched over a verification in flight
    llm.engine.core.scheduler.assert_idle()


def test_async_speculation_with_a_draft_model(tiny, launches):
    """A draft model (the target itself: its drafts are the target's greedy tokens) drafts only for
    requests whose tokens are back, and gives the plain tokens."""
    plain = _tokens(LLM(tiny, **OPTIONS))
    spec = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3}
    llm = LLM(tiny, speculative_config=spec, async_scheduling=True, **OPTIONS)
    assert _tokens(llm) == plain
    stats = llm.engine.stats().speculation
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
    assert not any(drafts for _, drafts in launches)
    llm.engine.core.scheduler.assert_idle()


def test_steps_without_drafts_run_ahead_and_probe_with_backoff(tiny, launches, monkeypatch):
    """A request whose tokens repeat no 5-gram gets no n-gram drafts: its first decode probes for
    drafts (its prefill settled first), then its steps run ahead, settling only to probe again, after
    4 steps ahead (twice the first back-off, 2 here), then 8."""
    monkeypatch.setattr(core_module, "FIRST_AHEAD_STEPS", 2)
    prompt = list(range(300, 320))
    plain = LLM(tiny, **OPTIONS).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny, speculative_config=SPEC | {"prompt_lookup_min": 5, "prompt_lookup_max": 5},
              async_scheduling=True, **OPTIONS)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert llm.engine.stats().speculation.num_draft_tokens == 0, "this test needs a prompt that gets no drafts"
    settled = [i for i, (in_flight, _) in enumerate(launches) if not in_flight]
    # the prefill (nothing in flight), a probe, 4 ahead, a probe, 8 ahead, a probe
    assert settled[:4] == [0, 1, 6, 15]
