"""A GGUF's quantized blocks under tensor parallelism: each rank keeps the blocks of its own shard,
whole rows of a column-parallel weight and whole 32-wide blocks of a row-parallel one, so they
dequantise to exactly the rank's slice of the weight; a split that would cut a block is refused with
the way out. A mixture-of-experts layer's GGUF block experts keep each rank's share of the
intermediate size: whole rows of gate and up, the share's columns of down, which must be whole blocks
(Qwen3-30B-A3B's moe_intermediate_size 768 in K-quants: refused over 2 ranks, 384 columns each, served
over 3, 256 each). The bundled SmolLM2 (9 heads, 3 KV heads) shards at N=3, not 2: over three ranks of one
thread it gives one rank's greedy tokens with the blocks on, and a tiny Qwen3-MoE GGUF with block experts
gives over two ranks one rank's tokens (`-m tp_full`: rank processes loading a model take tens of
seconds on this machine)."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from torch import nn

from blockserve.engine.llm import LLM
from blockserve.models.gguf_block_experts import GGUFBlockExperts, use_block_experts
from blockserve.models.moe import Experts, expert_ops
from blockserve.models.quantized_linear import FORMATS
from blockserve.sampling_params import SamplingParams
from blockserve.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, head_slice, kv_head_slice
from tests.distributed.processes import child_pids
from tests.models import test_moe_gguf_blocks
from tests.models.test_gguf_block_linear import random_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Shard(SimpleNamespace):
    """Enough of a TensorParallelGroup to build (not run) a rank's layer."""


def _blocks(rows: int, cols: int, format: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    weights = np.random.default_rng(seed).normal(0, 1, (rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[format])
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format])


@pytest.mark.parametrize("format", sorted(FORMATS))
def test_column_parallel_blocks_are_the_ranks_rows(format):
    """q | k | v of 4 heads and 2 KV heads of 8 rows: each rank's blocks hold its heads' rows."""
    raw, dense = _blocks(4 * 8 + 2 * 2 * 8, 64, format)
    for rank in range(2):
        tp = _Shard(rank=rank, size=2)
        q, kv = head_slice(4, 8, tp), kv_head_slice(2, 8, tp)
        with torch.device("meta"):
            layer = ColumnParallelLinear(64, [q, kv, kv], bias=False)
        local = layer.narrow_blocks(raw, FORMATS[format])
        expected = np.concatenate([dense[offset + s.start:offset + s.start + s.size]
                                   for offset, s in zip((0, 32, 48), (q, kv, kv))])
        np.testing.assert_array_equal(gguf.quants.dequantize(local, gguf.GGMLQuantizationType[format]), expected)


@pytest.mark.parametrize("format", sorted(FORMATS))
def test_row_parallel_blocks_are_the_ranks_columns(format):
    raw, dense = _blocks(8, 192, format)
    for rank in range(3):
        with torch.device("meta"):
            layer = RowParallelLinear(192, 8, False, _Shard(rank=rank, size=3), "in_features")
        local = layer.narrow_blocks(raw, FORMATS[format])
        np.testing.assert_array_equal(gguf.quants.dequantize(local, gguf.GGMLQuantizationType[format]),
                                      dense[:, rank * 64:(rank + 1) * 64])


def test_a_split_through_a_block_is_refused_with_the_way_out():
    raw, _ = _blocks(8, 64, "Q8_0")
    layer = RowParallelLinear(64, 8, False, _Shard(rank=0, size=4), "in_features")  # 16 inputs per rank
    with pytest.raises(ValueError, match="not whole 32-wide GGUF blocks.*--no-quantized-matmul"):
        layer.narrow_blocks(raw, FORMATS["Q8_0"])


def _rank_experts(raw: dict[str, tuple[str, np.ndarray]], hidden: int, intermediate: int, rank: int, size: int):
    """This rank's experts of a layer whose gate, up, down GGUF blocks are `raw`, as the loader builds them."""
    model = nn.Module()
    model.mlp = nn.Module()
    with torch.device("meta"):
        model.mlp.experts = Experts(next(iter(raw.values()))[1].shape[0], hidden, intermediate,
                                    _Shard(rank=rank, size=size))
    taken = use_block_experts(model, ((f"mlp.experts.{part}", *raw[part]) for part in ("gate", "up", "down")))
    assert taken == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    return model.mlp.experts


@pytest.mark.skipif(expert_ops() is None, reason="the block experts need the native extension")
def test_block_experts_keep_the_ranks_share():
    experts, hidden, intermediate, rng = 2, 256, 768, np.random.default_rng(3)
    formats = {"gate": "Q4_K", "up": "Q8_0", "down": "Q8_0"}
    raw = {part: (format, np.stack([random_blocks(format, *((hidden, intermediate) if part == "down" else
                                                             (intermediate, hidden)), rng) for _ in range(experts)]))
           for part, format in formats.items()}
    dense = {part: gguf.quants.dequantize(r, gguf.GGMLQuantizationType[f]) for part, (f, r) in raw.items()}
    for rank in range(2):
        module = _rank_experts(raw, hidden, intermediate, rank, 2)
        assert isinstance(module, GGUFBlockExperts) and module.intermediate_size == 384
        share = slice(rank * 384, (rank + 1) * 384)
        for part, segment in zip(("gate", "up", "down"), module.block_segments):
            held = gguf.quants.dequantize(segment.raw.numpy(), gguf.GGMLQuantizationType[segment.format])
            want = dense[part][:, :, share] if part == "down" else dense[part][:, share]
            np.testing.assert_array_equal(held, want)


@pytest.mark.skipif(expert_ops() is None, reason="the block experts need the native extension")
def test_qwen3_30b_a3b_k_quant_experts_shard_over_three_ranks_not_two():
    """Its real expert shape (hidden 2048, moe_intermediate_size 768), two experts, down in Q6_K."""
    hidden, intermediate, rng = 2048, 768, np.random.default_rng(4)
    raw = {"gate": ("Q4_K", np.stack([random_blocks("Q4_K", intermediate, hidden, rng)] * 2)),
           "up": ("Q4_K", np.stack([random_blocks("Q4_K", intermediate, hidden, rng)] * 2)),
           "down": ("Q6_K", np.stack([random_blocks("Q6_K", hidden, intermediate, rng)] * 2))}
    with pytest.raises(ValueError, match="768 columns over 2 ranks are 384 per rank, not whole 256-wide Q6_K GGUF "
                                         "blocks: serve it with --no-quantized-matmul"):
        _rank_experts(raw, hidden, intermediate, 0, 2)
    for rank in range(3):
        assert _rank_experts(raw, hidden, intermediate, rank, 3).intermediate_size == 256


def test_a_row_parallel_block_linear_cutting_a_block_is_refused():
    """Not kept as float32 without a word: the load stops, naming the way out."""
    from blockserve.models.gguf_block_linear import use_block_modules
    model = nn.Module()
    with torch.device("meta"):
        model.proj = RowParallelLinear(512, 8, False, _Shard(rank=0, size=4), "in_features")  # 128 inputs a rank
    raw = random_blocks("Q4_K", 8, 512, np.random.default_rng(5))
    with pytest.raises(ValueError, match="512 columns over 4 ranks are 128 per rank, not whole 256-wide Q4_K"):
        use_block_modules(model, [("proj.weight", "Q4_K", raw)])


@pytest.mark.tp_full
@pytest.mark.slow  # two rank processes loading the model
@pytest.mark.skipif(expert_ops() is None, reason="the block experts need the native extension")
def test_qwen3_moe_block_experts_over_two_ranks_give_one_ranks_tokens(tmp_path, monkeypatch):
    """test_moe_gguf_blocks' Qwen3-MoE (experts in Q4_K / Q6_K and Q8_0, attention in Q4_K) with 512-wide
    experts and heads of 128: 256 columns a rank of down and of o_proj, whole K-quant blocks."""
    monkeypatch.setattr(test_moe_gguf_blocks, "EXPERT_FFN", 512)
    monkeypatch.setattr(test_moe_gguf_blocks, "HEAD_DIM", 128)
    path = tmp_path / "model.gguf"
    test_moe_gguf_blocks.write_qwen3_moe_gguf(path)
    monkeypatch.setenv("BLOCKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = dict(num_threads=1, kv_cache_memory="4MiB", max_model_len=128, max_num_batched_tokens=32)
    outputs = []
    before = child_pids()
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, distributed_timeout_s=120, **engine) as llm:
            experts = [m for m in llm.engine.core.loaded.model.modules() if isinstance(m, GGUFBlockExperts)]
            assert len(experts) == test_moe_gguf_blocks.LAYERS
            assert {e.intermediate_size for e in experts} == {512 // size}
            outputs.append([o.outputs[0].token_ids for o in llm.generate(test_moe_gguf_blocks.PROMPTS, params,
                                                                         use_tqdm=False)])
    assert not child_pids() - before
    assert outputs[1] == outputs[0]


@pytest.mark.tp_full
@pytest.mark.slow  # three rank processes loading the real model
def test_smollm2_gguf_over_three_ranks_gives_one_ranks_tokens():
    prompts = [[1, 504, 3458, 314, 260, 3287, 28], list(range(200, 230))]
    params = SamplingParams(temperature=0, max_tokens=12)
    engine = dict(num_threads=1, kv_cache_memory="16MiB", max_model_len=128, max_num_batched_tokens=32)
    outputs = []
    before = child_pids()
    for size in (1, 3):
        with LLM(None, tensor_parallel_size=size, distributed_timeout_s=120, **engine) as llm:
            quantized = sum(type(m).__name__ == "QuantizedLinear" for m in llm.engine.core.loaded.model.modules())
            assert quantized > 0  # the blocks serve the decodes on every rank count
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert not child_pids() - before
    assert outputs[1] == outputs[0]
