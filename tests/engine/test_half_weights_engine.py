"""A bfloat16 Hugging Face checkpoint through the whole engine on the CPU: dtype auto keeps its
weights in 16 bits and gives transformers' greedy tokens and logprobs (its float32 model loaded
from the same 16-bit values); dtype float32 widens them as they load; the start-up report says
what the weights hold."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Qwen2Config

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.device import resolve_device_plan
from blockserve.models.half_linear import HalfLinear
from blockserve.models.loader import load_model
from blockserve.models.placement import Placement
from tests.models.test_half_weights import SIZES, float32_reference, save_16bit
from tests.parity import assert_greedy_parity, assert_logprobs_close, reference_outputs
from tests.scenarios import engine_prompts

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def bf16_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-tied-bf16")
    save_16bit(Qwen2Config(**SIZES, tie_word_embeddings=True), torch.bfloat16, path)
    return path, reference_outputs(float32_reference(path), engine_prompts(), NEW_TOKENS)


def _generate(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5)
    return llm.generate(engine_prompts(), params, use_tqdm=False)


def test_dtype_auto_keeps_16bit_weights_and_matches_transformers(bf16_tied, caplog):
    path, reference = bf16_tied
    with caplog.at_level(logging.INFO, logger="blockserve"):
        llm = LLM(str(path), block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=16, check_integrity=True)
    model = llm.engine.core.loaded.model
    linears = [m for m in model.modules() if isinstance(m, HalfLinear)]
    assert linears and all(linear.weight.dtype == torch.bfloat16 for linear in linears)
    assert model.tied_lm_head is not None
    outputs = _generate(llm)
    assert_greedy_parity([o.outputs[0].token_ids for o in outputs], reference)
    assert_logprobs_close(outputs, reference)
    assert any("weights resident:" in r.getMessage() and "bfloat16" in r.getMessage() for r in caplog.records)
    llm.engine.core.scheduler.assert_idle()


def test_dtype_float32_widens_every_weight(bf16_tied):
    path, reference = bf16_tied
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB")
    model = llm.engine.core.loaded.model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(isinstance(m, HalfLinear) for m in model.modules())
    assert_greedy_parity([o.outputs[0].token_ids for o in _generate(llm)], reference)


def test_a_model_keeping_16bit_weights_refuses_dtype_float32(bf16_tied):
    path, _ = bf16_tied
    loaded = load_model(str(path), BACKENDS["exact"], placement=Placement(keep_16bit_weights=True))
    with pytest.raises(ValueError, match="keeps its 16-bit weights"):
        LLM(loaded, dtype="float32")


@pytest.mark.parametrize("device, dtype, cuda, keep", [("cpu", "auto", False, True), ("auto", "auto", False, True),
                                                       ("cpu", "float32", False, False),
                                                       ("cpu", "bfloat16", False, False),
                                                       ("auto", "auto", True, False)])
def test_only_dtype_auto_on_the_cpu_keeps_16bit_weights(device, dtype, cuda, keep):
    plan = resolve_device_plan(device, dtype, None, cuda_available=cuda, cuda_count=1 if cuda else 0)
    assert plan.keep_16bit_weights is keep and plan.placement.keep_16bit_weights is keep
