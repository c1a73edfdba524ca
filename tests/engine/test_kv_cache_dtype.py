"""kv_cache_dtype: attention K/V stored as float16 or bfloat16 through the whole engine.

The tiny model has head size 64, so decodes go to the native kernel's 16-bit path where it is
built (AVX-512 or AVX2), else to the gathered PyTorch path. With float16 (11-bit mantissa) the greedy
outputs must stay those of the float32 cache. bfloat16 (8 bits) rounds 8x coarser, enough to flip
this random model's greedy picks within a few tokens, so for it only the storage is checked here
(tests/attention checks its reads exactly). Either way the cache must really hold 16-bit values,
and the same memory must hold twice the blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.engine.config import EngineConfig
from blockserve.models.random_checkpoint import save_random_model

CONFIG = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
PROMPT_LENS = (3, 9, 21, 30, 44)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-head64")
    save_random_model(LlamaConfig(**CONFIG), path)
    return str(path)


def run(path: str, kv_cache_dtype: str) -> tuple[list[list[int]], LLM]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(path, block_size=16, kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_cache_keeps_the_float32_outputs(model_path, dtype):
    want, full = run(model_path, "auto")
    got, half = run(model_path, dtype)
    if dtype == "float16":
        assert got == want
    assert all(len(tokens) == 40 for tokens in got)
    caches = half.engine.core.runner.layer_caches.values()
    assert {c.k_cache.dtype for c in caches} == {getattr(torch, dtype)}
    blocks = lambda llm: sum(g.num_blocks for g in llm.engine.core.kv_config.groups)  # noqa: E731
    assert blocks(half) >= 2 * blocks(full) - 2


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
