"""Tiny random hybrid models (Qwen3-Next: Gated DeltaNet; Granite 4.0-H: Mamba2) through the whole
engine (LLM.generate) against transformers, and the C1 multi-epoch poison scenario.

The engine scenarios (tests/scenarios.py): batched, with prefix caching on (the second pass
restores state checkpoints) and off, chunked prefill forced by a small token budget, and preemption
forced by a small KV cache. The poison scenario runs the same 16 prompts three times through one
engine whose free blocks and state slots are NaN and recycled: with the derived zero flags every
epoch equals transformers; with zeroing disabled, a recycled slot's stale state corrupts later
epochs.

Greedy tokens equal transformers' (`assert_greedy_parity` allowing no near-tie). None occurs: the
reference's smallest top-2 gap over these 128 steps is 8.7e-3 nats (Granite; 1.7e-2 Qwen3-Next),
~350x the largest difference between the engine's and transformers' log-probabilities measured.
"""

from __future__ import annotations

import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import LinearStateSpec
from blockserve.models.loader import load_model
from tests.models.conftest import STATE_CONFIGS, state_model_prompts, tiny_model  # noqa: F401 (a fixture)
from tests.parity import assert_greedy_parity, greedy_tokens, reference_outputs
from tests.scenarios import ENGINE_SCENARIOS, engine_options

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # the longest prompt (37) + NEW_TOKENS fits


def cache_bytes(model, max_num_seqs: int, attention_blocks: int) -> int:
    """A KV budget of exactly `attention_blocks` usable blocks per attention layer, beside the state slots."""
    total = 0
    for spec in model.kv_cache_specs(BLOCK_SIZE).values():
        slots_or_blocks = max_num_seqs + 1 if isinstance(spec, LinearStateSpec) else attention_blocks + 1
        total += slots_or_blocks * spec.page_size_bytes
    return total + 1


# 18 blocks of 4 tokens hold one request of MAX_MODEL_LEN (16 blocks), far fewer than 16 prompts need.
SMALL_CACHE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4)


@pytest.fixture(scope="module", params=sorted(STATE_CONFIGS))
def hybrid(request, tiny_model):
    """(model path, the loaded model, transformers' reference_outputs for state_model_prompts())."""
    path, reference = tiny_model(request.param)
    expected = reference_outputs(reference, state_model_prompts(), NEW_TOKENS)
    return path, load_model(str(path), BACKENDS["exact"]), expected


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(state_model_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
def test_engine_matches_transformers(hybrid, scenario):
    path, loaded, expected = hybrid
    small = dict(SMALL_CACHE, kv_cache_memory=cache_bytes(loaded.model, SMALL_CACHE["max_num_seqs"], attention_blocks=18))
    options = engine_options(scenario, base={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "16MiB"},
                             preemption=small)
    llm = LLM(str(path), block_size=BLOCK_SIZE, check_integrity=True, **options)
    assert_greedy_parity(generate(llm), expected)
    scheduler = llm.engine.core.scheduler
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix-caching":
        assert_greedy_parity(generate(llm), expected)  # shared prefixes, a second pass
        stats = scheduler.kv.prefix_cache_stats()
        if llm.engine.core.kv_config.checkpoint_stride <= 13:  # Granite's 8-token scan chunks: these prompts hit
            assert stats.hits > 0 and stats.checkpoint_restores > 0, stats
    scheduler.assert_idle()


def test_state_group_is_zeroed_and_reported(hybrid):
    """C1: the state group's zero flag comes from its spec (the recurrent modules declare no unwritten
    reads); the capacity report counts its state slots."""
    _, loaded, _ = hybrid
    llm = LLM(loaded, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_cache_memory="4MiB")
    groups = llm.engine.core.kv_config.groups
    assert sorted((g.is_state, g.zero_new_blocks) for g in groups) == [(False, False), (True, True)]
    state = next(g for g in groups if g.is_state)
    assert state.num_blocks == 5 and len(state.layer_names) == 2
    assert "4 state slots" in llm.engine.core.kv_config.capacity_report()


def test_poisoned_epochs(hybrid):
    """C1, multi-epoch: 3 passes of 16 prompts through one engine with NaN in every free block and slot,
    4 state slots and 18 blocks recycled over and over (with preemption). With the derived zero flags
    every epoch is token-identical to the first and to transformers; with zeroing disabled a new
    request starts from the state its slot's last owner left, and later epochs diverge."""
    _, loaded, expected = hybrid
    options = dict(block_size=BLOCK_SIZE, check_integrity=True, **SMALL_CACHE,
                   kv_cache_memory=cache_bytes(loaded.model, SMALL_CACHE["max_num_seqs"], attention_blocks=18))
    llm = LLM(loaded, poison=True, **options)
    epochs = [generate(llm) for _ in range(3)]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert epochs[1] == epochs[0] and epochs[2] == epochs[0]
    assert_greedy_parity(epochs[0], expected)

    unzeroed = LLM(loaded, unsafe_disable_zeroing=True, **options)
    stale = [generate(unzeroed) for _ in range(3)]
    greedy = greedy_tokens(expected)
    assert stale[1] != greedy and stale[2] != greedy
