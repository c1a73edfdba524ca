"""Tiny random Llama-family models through the whole engine (LLM.generate) against transformers.

The engine scenarios (tests/scenarios.py: batched, with prefix caching on and off, chunked prefill
forced by a small token budget, and preemption forced by a small KV cache) over the suite's
backends; plus the C1 poison test for each backend.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.parity import assert_greedy_parity, greedy_tokens, reference_outputs
from tests.scenarios import ENGINE_SCENARIOS, SUITE_BACKENDS, engine_options, engine_prompts

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "qwen2": lambda: Qwen2Config(**SIZES, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=32),
}
NEW_TOKENS = 12
# A block of 4 tokens holds 2 layers x (K, V) x 2 heads x head_size x 4 bytes: 4 KiB at head_size 32.
# 17 such blocks hold one request of max_model_len 64, far fewer than the ~50 the prompts need.
SMALL_CACHE = dict(max_model_len=64, kv_cache_memory=17 * 4096)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(CONFIGS[request.param](), path)
    return path, reference_outputs(reference, engine_prompts(), NEW_TOKENS)


def generate(llm: LLM, runs: int = 1) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for _ in range(runs):
        outputs = llm.generate(engine_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_engine_matches_transformers(tiny, backend, scenario):
    path, reference = tiny
    llm = LLM(str(path), block_size=4, attention_backend=backend, check_integrity=True,
              **engine_options(scenario, base={"kv_cache_memory": "4MiB"}, preemption=SMALL_CACHE))
    assert_greedy_parity(generate(llm), reference)
    scheduler = llm.engine.core.scheduler
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix-caching":
        assert_greedy_parity(generate(llm), reference)  # the second pass is served from the cache
        assert scheduler.kv.prefix_cache_stats().hits > 0
    scheduler.assert_idle()


@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_poisoned_cache_without_zeroing(tiny, backend):
    """C1: with every garbage block NaN and zeroing forced off, the exact-length backend still
    matches; the whole-block backend, which reads unwritten slots, breaks. With the derived
    flags both match."""
    path, reference = tiny
    expected = greedy_tokens(reference)
    loaded = load_model(str(path), BACKENDS[backend])
    options = dict(block_size=4, poison=True, **SMALL_CACHE)
    unzeroed = generate(LLM(loaded, unsafe_disable_zeroing=True, **options), runs=2)
    if BACKENDS[backend].reads_unwritten_slots:
        assert unzeroed != expected
    else:
        assert unzeroed == expected
    assert generate(LLM(loaded, **options), runs=2) == expected
