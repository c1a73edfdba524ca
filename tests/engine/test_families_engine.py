"""Tiny random dense and mixture-of-experts families (tests/models/test_dense_families.py: Mistral and
Qwen2 with sliding windows, Gemma 2, Phi-3 / Phi-4-mini, OLMo 2, Granite, SmolLM3, GLM-4, EXAONE 4;
tests/models/test_moe_families.py: Mixtral, Qwen2-MoE, Qwen3-MoE; tests/models/test_gpt_oss.py: GPT-OSS, with
attention sinks and a window of 8) through the whole engine
(LLM.generate) against transformers.

Batched (prompts of 3 to 30 tokens, longer than every sliding window), with prefix caching on (a
second pass is served from the cache) and off, chunked prefill forced by a small token budget, and
preemption forced by a KV cache of 2 blocks per layer more than one request of max_model_len 64
holds (`small_cache`). Greedy tokens equal transformers' (`assert_greedy_parity` allowing no near-tie),
and every step's log-probabilities of the sampled token and the top 5 within 1e-4 of transformers'.
Measured: the largest difference under 1e-5 nats; the reference's smallest top-2 gap 3.4e-4 nats
(Gemma 2; every other family above 1e-3), so no near-tie can flip.
Tensor parallelism: 2 ranks against one, for every dense family but OLMo 2 (refused); the MoE
families' in tests/distributed/test_tp_moe.py.
"""

from __future__ import annotations

import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import SlidingWindowSpec
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.test_dense_families import DENSE_CONFIGS
from tests.models.test_gpt_oss import GPT_OSS_CONFIGS
from tests.models.test_moe_families import MOE_CONFIGS
from tests.parity import assert_greedy_parity, assert_logprobs_close, reference_outputs
from tests.scenarios import ENGINE_SCENARIOS, engine_options, engine_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # the longest prompt (30) + NEW_TOKENS fits
STEP_TOKENS = 16  # the preemption scenario's step budget
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5)


FAMILIES = {**DENSE_CONFIGS, **MOE_CONFIGS, **GPT_OSS_CONFIGS}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model path, transformers' reference_outputs for engine_prompts())."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(FAMILIES[request.param](), path)
    return path, reference_outputs(reference, engine_prompts(), NEW_TOKENS)


def small_cache(path) -> dict:
    """A KV budget of 2 blocks per layer more than one request of MAX_MODEL_LEN holds (plus the null
    block), prefilled in chunks of at most STEP_TOKENS: 18 blocks of a full-attention layer, 10 of a
    sliding layer with a window of 10. Four running requests need more."""
    model = load_model(str(path), BACKENDS["exact"]).model
    blocks = sum((spec.max_blocks_held(MAX_MODEL_LEN, STEP_TOKENS) + 3) * spec.page_size_bytes
                 for spec in model.kv_cache_specs(BLOCK_SIZE).values())
    return dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=STEP_TOKENS,
                kv_cache_memory=blocks + 1)


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
def test_engine_matches_transformers(family, scenario):
    path, expected = family
    options = engine_options(scenario, preemption=small_cache(path),
                             base=dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB"))
    with LLM(str(path), block_size=BLOCK_SIZE, check_integrity=True, **options) as llm:
        sliding = [g for g in llm.engine.core.kv_config.groups if isinstance(g.spec, SlidingWindowSpec)]
        assert all(len(p) > g.spec.sliding_window for g in sliding for p in engine_prompts()[2:])
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


TP_ENGINE = dict(num_threads=1, kv_cache_memory="8MiB", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
TP_DEFAULT = "phi4-mini-partial"  # fused q/k/v and gate/up checkpoint tensors narrowed per rank; the rest: tp_full


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == TP_DEFAULT else [pytest.mark.tp_full])
                                  for n in sorted(DENSE_CONFIGS) if n != "olmo2"])
def test_tensor_parallel_equals_one_rank(tmp_path, name):
    """2 gloo ranks give one rank's greedy tokens, and its top-3 log-probabilities within 1e-4 (partial
    sums added in another order). OLMo 2 refuses (test_dense_families.py)."""
    save_random_model(DENSE_CONFIGS[name](), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3)
    runs = []
    for tp in (1, 2):
        with LLM(str(tmp_path), tensor_parallel_size=tp, **TP_ENGINE) as llm:
            runs.append(llm.generate(engine_prompts(), params, use_tqdm=False))
    for one, two in zip(*runs):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for step_one, step_two in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert step_one.keys() == step_two.keys()
            assert all(abs(step_one[t].logprob - step_two[t].logprob) < 1e-4 for t in step_one)
