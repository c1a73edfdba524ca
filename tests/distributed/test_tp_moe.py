"""A mixture-of-experts family over 2 gloo ranks of one thread each: tiny Qwen2-MoE (q/k/v biases,
dense and MoE layers, 8 experts and the sigmoid-gated shared expert, all sharded by intermediate
size; the router whole on each rank) gives transformers' greedy tokens, and every step's top-5
log-probabilities within 1e-4 of them. Mixtral and Qwen3-MoE shard the same modules (models/moe.py,
the Llama family's attention), so one engine stands for the three (each TP=2 engine spawns a process
that imports torch: seconds)."""

from __future__ import annotations

import pytest

from blockserve.engine.llm import LLM
from blockserve.models.random_checkpoint import save_random_model
from blockserve.sampling_params import SamplingParams
from tests.distributed.processes import child_pids
from tests.models.test_moe_families import MOE_CONFIGS
from tests.parity import assert_greedy_parity, assert_logprobs_close, reference_outputs
from tests.scenarios import engine_prompts

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # rank processes

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=5)


def test_qwen2_moe_tp2_matches_transformers(tmp_path):
    before = child_pids()
    reference = save_random_model(MOE_CONFIGS["qwen2_moe"](), tmp_path)
    expected = reference_outputs(reference, engine_prompts(), PARAMS.max_tokens)
    with LLM(str(tmp_path), tensor_parallel_size=2, num_threads=1, kv_cache_memory="8MiB", max_model_len=64,
             max_num_batched_tokens=16) as llm:
        outputs = llm.generate(engine_prompts(), PARAMS, use_tqdm=False)
        assert llm.engine.core.kv_config.groups[0].spec.num_kv_heads == 1  # 2 KV heads over 2 ranks
    assert not child_pids() - before  # closed: rank 1 has exited and been reaped
    assert_greedy_parity([o.outputs[0].token_ids for o in outputs], expected)
    assert_logprobs_close(outputs, expected)
