"""Tensor parallelism over a bfloat16 checkpoint with its 16-bit weights kept (dtype auto): each rank
holds its shards of the linear layers (a row-parallel one all-reduces its partial products), the
vocab-parallel embedding and the LM head (tied: the embedding's rows) in bfloat16, and TP=2 gives
TP=1's greedy tokens and logprobs within 1e-4 (test_tp_engine.py's rule)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from blockserve.engine.llm import LLM
from blockserve.models.half_linear import HalfLinear
from tests.distributed.test_tp_engine import ENGINE, PARAMS, PROMPTS, _assert_same
from tests.models.test_half_weights import save_16bit

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {"llama-odd-vocab": lambda: LlamaConfig(**_SIZES, vocab_size=511),
           "qwen2-tied": lambda: Qwen2Config(**_SIZES, vocab_size=512, tie_word_embeddings=True)}


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tp2_equals_tp1_with_16bit_weights(tmp_path, family):
    save_16bit(CONFIGS[family](), torch.bfloat16, tmp_path)
    runs = []
    for size in (1, 2):
        with LLM(str(tmp_path), **ENGINE, tensor_parallel_size=size) as llm:
            model = llm.engine.core.loaded.model  # rank 0's shard
            linears = [m for m in model.model.modules() if isinstance(m, HalfLinear)]
            assert len(linears) == 4 * 2 and all(linear.weight.dtype == torch.bfloat16 for linear in linears)
            assert sum(linear.tp is not None for linear in linears) == (2 * 2 if size == 2 else 0)  # o, down
            assert model.model.embed_tokens.weight.dtype == torch.bfloat16
            head = model.tied_lm_head if model.tie_word_embeddings else model.lm_head
            assert head.weight.dtype == torch.bfloat16
            runs.append(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    _assert_same(*runs)
