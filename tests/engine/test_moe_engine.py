"""Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE (tests/models/test_moe_families.py) through the whole
engine (LLM.generate) against transformers.

Batched, with prefix caching on (a second pass is served from the cache) and off, chunked prefill
forced by a small token budget, and preemption forced by a KV cache of 18 blocks per layer (one
request of max_model_len 64 fits; the batch does not). Greedy tokens equal transformers'
(`assert_greedy_parity` allowing no near-tie), and every step's log-probabilities of the sampled
token and the top 5 within 1e-4 of transformers'. Measured: the largest difference 8.6e-6 nats, the
reference's smallest top-2 gap 4.5e-3 nats (Mixtral; 6.7e-3 Qwen2-MoE, 4.3e-2 Qwen3-MoE), so no
near-tie can flip.
"""

from __future__ import annotations

import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.test_moe_families import MOE_CONFIGS
from tests.parity import assert_greedy_parity, reference_outputs
from tests.scenarios import ENGINE_SCENARIOS, engine_options, engine_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # the longest prompt (30) + NEW_TOKENS fits
LOGPROB_TOLERANCE = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5)


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def family(request, tmp_path_factory):
    """(model path, transformers' reference_outputs for engine_prompts())."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(MOE_CONFIGS[request.param](), path)
    return path, reference_outputs(reference, engine_prompts(), NEW_TOKENS)


def small_cache(path) -> dict:
    """A KV budget of exactly 18 usable blocks of BLOCK_SIZE tokens per layer (plus the null block)."""
    model = load_model(str(path), BACKENDS["exact"]).model
    blocks = sum(19 * spec.page_size_bytes for spec in model.kv_cache_specs(BLOCK_SIZE).values())
    return dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_cache_memory=blocks + 1)


def assert_logprobs_close(outputs, expected) -> None:
    """Each step's sampled and top-5 log-probabilities within LOGPROB_TOLERANCE of transformers'."""
    for output, (_, want_steps) in zip(outputs, expected):
        steps = output.outputs[0].logprobs
        assert len(steps) == len(want_steps) == NEW_TOKENS
        for step, want in zip(steps, want_steps):
            assert len(step) >= 5
            for token, logprob in step.items():
                assert abs(logprob.logprob - float(want[token])) < LOGPROB_TOLERANCE, (token, logprob, float(want[token]))


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
def test_engine_matches_transformers(family, scenario):
    path, expected = family
    options = engine_options(scenario, preemption=small_cache(path),
                             base=dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB"))
    with LLM(str(path), block_size=BLOCK_SIZE, check_integrity=True, **options) as llm:
        for _ in range(2 if scenario == "prefix-caching" else 1):  # the second pass: from the prefix cache
            outputs = llm.generate(engine_prompts(), PARAMS, use_tqdm=False)
            assert_greedy_parity([o.outputs[0].token_ids for o in outputs], expected)
            assert_logprobs_close(outputs, expected)
        scheduler = llm.engine.core.scheduler
        if scenario == "preemption":
            assert scheduler.num_preemptions > 0
        if scenario == "prefix-caching":
            assert sum(o.num_cached_tokens for o in outputs) > 0
        scheduler.assert_idle()
