"""A GGUF's quantized blocks under tensor parallelism: each rank keeps the blocks of its own shard,
whole rows of a column-parallel weight and whole 32-wide blocks of a row-parallel one, so they
dequantise to exactly the rank's slice of the weight; a split that would cut a block is refused with
the way out. The bundled SmolLM2 (9 heads, 3 KV heads) shards at N=3, not 2: over three ranks of one
thread it gives one rank's greedy tokens with the blocks on (`-m tp_full`: three processes loading
the model take tens of seconds on this machine)."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from blockserve.engine.llm import LLM
from blockserve.models.quantized_linear import FORMATS
from blockserve.sampling_params import SamplingParams
from blockserve.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, head_slice, kv_head_slice
from tests.distributed.processes import child_pids

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
