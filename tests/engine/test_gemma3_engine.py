"""A tiny random Gemma 3 through the whole engine against transformers: two KV groups (a sliding
window of 10 tokens over 3 local layers, full attention over 1 global layer) with different specs.

The engine scenarios (tests/scenarios.py: batched, prefix caching on and off, chunked prefill
forced, preemption forced) over the suite's backends, the C1 poison epochs for each backend, and
the sliding group's memory bound on a long request.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Gemma3TextConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.kv.specs import cdiv
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.parity import assert_greedy_parity, greedy_tokens, reference_outputs
from tests.scenarios import ENGINE_SCENARIOS, SUITE_BACKENDS, engine_options, engine_prompts

S, F = "sliding_attention", "full_attention"
WINDOW = 10  # not a multiple of the block size
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=256,
              sliding_window=WINDOW, layer_types=[S, S, F, S], bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
NEW_TOKENS = 12
# Blocks of 4 tokens; one layer's block is 2 (K, V) x 4 x 2 heads x 16 x 4 bytes = 1 KiB. With a
# 16-token step budget a request of 64 tokens holds at most 8 sliding blocks (x 3 layers) and 16
# full ones: 40 KiB, + 4 KiB of null blocks. 60 KiB holds one such request but not the batch.
SMALL_CACHE = dict(max_model_len=64, max_num_batched_tokens=16, kv_cache_memory=60 * 1024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    reference = save_random_model(Gemma3TextConfig(**CONFIG), path)
    return path, reference, reference_outputs(reference, engine_prompts(), NEW_TOKENS)


def generate(llm: LLM, runs: int = 1) -> list[list[list[int]]]:
    """The tokens of each pass of the prompt set through one engine."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    passes = []
    for _ in range(runs):
        outputs = llm.generate(engine_prompts(), params, use_tqdm=False)
        passes.append([o.outputs[0].token_ids for o in outputs])
    return passes


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_engine_matches_transformers(tiny, backend, scenario):
    path, _, reference = tiny
    llm = LLM(str(path), block_size=4, attention_backend=backend, check_integrity=True,
              **engine_options(scenario, base={"kv_cache_memory": "4MiB"}, preemption=SMALL_CACHE))
    groups = llm.engine.core.kv_config.groups
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec, FullAttentionSpec]
    assert [len(g.layer_names) for g in groups] == [3, 1]
    runs = 2 if scenario == "prefix-caching" else 1  # the second pass is served from the cache
    for tokens in generate(llm, runs):
        assert_greedy_parity(tokens, reference)
    scheduler = llm.engine.core.scheduler
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix-caching":
        assert scheduler.kv.prefix_cache_stats().hits > 0
    scheduler.assert_idle()


@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_poisoned_epochs(tiny, backend):
    """C1, the stale-block scenario: three passes of the prompt set through one engine whose every
    garbage block (including sliding blocks released mid-request) is NaN, in a cache small enough
    to recycle blocks constantly. With the derived zero flags every epoch equals epoch 1 and
    transformers. With zeroing forced off, the whole-block backend (which reads unwritten slots)
    breaks and the exact-length one does not."""
    path, _, reference = tiny
    expected = greedy_tokens(reference)
    loaded = load_model(str(path), BACKENDS[backend])
    options = dict(block_size=4, poison=True, check_integrity=True, **SMALL_CACHE)
    llm = LLM(loaded, **options)
    reads_unwritten = BACKENDS[backend].reads_unwritten_slots
    assert [g.zero_new_blocks for g in llm.engine.core.kv_config.groups] == [reads_unwritten] * 2
    epochs = generate(llm, runs=3)
    assert all(epoch == epochs[0] for epoch in epochs)
    assert epochs[0] == expected
    assert llm.engine.core.scheduler.num_preemptions > 0  # blocks really were recycled
    assert llm.engine.core.kv.prefix_cache_stats().hits > 0  # and cached sliding blocks reused
    (unzeroed,) = generate(LLM(loaded, unsafe_disable_zeroing=True, **options))  # every block starts as NaN
    if reads_unwritten:
        assert unzeroed != expected
    else:
        assert unzeroed == expected


def held(llm: LLM, request_id: str) -> list[int]:
    """Blocks (not counting null entries) the request holds in each KV group."""
    coordinator = llm.engine.core.kv.coordinator
    return [sum(b is not pool.null_block for b in manager.req_blocks.get(request_id, ()))
            for manager, pool in zip(coordinator.managers, coordinator.pools)]


def test_long_request_holds_a_window_of_blocks(tiny, caplog):
    """A request of 30 prompt tokens, prefilled in chunks of 4, then 40 decoded (7 windows in
    all) holds at most ceil(window / block_size) + 1 blocks in its sliding group after every
    decode step (the spec's chunk bound while prefilling) while its full group grows with it,
    and its tokens equal transformers'. The capacity report shows both groups."""
    path, reference, _ = tiny
    block_size, prompt_len, chunk, new_tokens = 4, 30, 4, 40
    with caplog.at_level(logging.INFO, logger="blockserve"):
        llm = LLM(str(path), block_size=block_size, max_model_len=128, kv_cache_memory="1MiB",
                  check_integrity=True, max_prefill_chunk=chunk)
    report = llm.engine.core.kv_config.capacity_report()
    assert "group 0 SlidingWindowSpec (3 layers)" in report and "group 1 FullAttentionSpec (1 layers)" in report
    assert report in caplog.text  # printed at start-up
    sliding = llm.engine.core.kv_config.groups[0].spec
    prompt = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=new_tokens))
    decode_bound = cdiv(WINDOW, block_size) + 1
    most = 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
        request = engine.core.scheduler.requests.get("long")
        if request is None:
            continue  # finished: a last step hands its release to the worker
        sliding_held, full_held = held(llm, "long")
        computed = request.num_computed_tokens
        bound = decode_bound if computed >= prompt_len else sliding.max_blocks_held(computed, chunk)
        assert sliding_held <= bound, f"{sliding_held} sliding blocks held at {computed} tokens (bound {bound})"
        assert full_held == cdiv(computed, block_size)
        if computed >= prompt_len:
            most = max(most, sliding_held)
    assert most == decode_bound  # reached, so the bound is tight
    assert_greedy_parity([tokens], reference_outputs(reference, [prompt], new_tokens))
    engine.core.scheduler.assert_idle()
