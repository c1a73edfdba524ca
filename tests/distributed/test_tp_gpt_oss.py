"""GPT-OSS under tensor parallelism.

Without processes (the default run): a tiny GPT-OSS is built as each of two ranks builds it (a stand-in
group whose all-reduce is the identity) and loaded from one checkpoint. Each rank's sinks are its
heads' sinks; each expert's gate|up columns (or MXFP4 rows) are the rank's share of the
intermediate size with gate and up still interleaved, down's rows (or whole MXFP4 blocks of its
inputs) that share, the gate|up bias those entries and down's bias on rank 0 only; and the ranks'
MoE outputs summed are one device's, for float, MXFP4 and GGUF Q8_0 block experts (the clamped
SwiGLU is not symmetric in gate and up, so a share that mixed them up would not sum back). A share
that cuts an MXFP4 block or a GGUF block is refused at build, naming the tensor and the way out.

Over two gloo ranks (`-m tp_full`: each engine starts rank processes that load the model, tens of
seconds here): the engine's greedy tokens at TP=2 equal TP=1's and transformers', on prompts longer
than the sliding window (8 tokens) prefilled in chunks, from a bfloat16 checkpoint, an MXFP4 one, the
GGUF of the MXFP4 one and a GGUF with Q8_0 experts (run from the file's blocks).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, Mxfp4Config

from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.llm import LLM
from blockserve.models.gguf_block_experts import GptOssGGUFBlockExperts, use_block_experts
from blockserve.models.gpt_oss import GptOssExperts, GptOssForCausalLM, gpt_oss_expert_ops
from blockserve.models.mxfp4 import dequantize_mxfp4
from blockserve.models.placement import Placement
from blockserve.models.random_checkpoint import save_random_model
from blockserve.sampling_params import SamplingParams
from tests.distributed.processes import child_pids
from tests.models.mxfp4_encoder import encode_mxfp4
from tests.models.test_gpt_oss import GPT_OSS_CONFIGS, WINDOW
from tests.models.test_gpt_oss_gguf import write_block_experts_gguf, write_gguf
from tests.models.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint
from tests.models.test_half_weights import float32_reference, save_16bit
from tests.models.test_moe_gguf_blocks import _blocks
from tests.parity import assert_greedy_parity, reference_outputs
from tests.scenarios import engine_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INTERMEDIATE = 64  # two ranks of 32: one whole MXFP4 block of down's inputs each
PROJECTIONS = ("gate_up_proj", "down_proj")


class _Rank(SimpleNamespace):
    """Enough of a TensorParallelGroup to build and run one rank's shard in this process: its
    all-reduce leaves the rank's partial sum, which the test adds up, and counts the calls."""

    reductions = 0

    def all_reduce(self, tensor: torch.Tensor, **_) -> torch.Tensor:
        self.reductions += 1
        return tensor


def _rank(rank: int, size: int) -> _Rank:
    return _Rank(rank=rank, size=size, is_first=rank == 0)


def _checkpoint(mxfp4: bool):
    """(config, checkpoint tensors) of a tiny random GPT-OSS, its experts in MXFP4 or float32."""
    config = GPT_OSS_CONFIGS["gpt_oss"](intermediate_size=INTERMEDIATE)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0, 0.2)
    tensors = dict(reference.state_dict())
    if mxfp4:
        config.quantization_config = {"quant_method": "mxfp4"}
        for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
            blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2).double().numpy())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    return config, tensors


def _built(config, tensors, tp=None) -> GptOssForCausalLM:
    model = GptOssForCausalLM(config, BACKENDS["exact"], Placement(tp=tp))
    model.load_weights(tensors.items())
    return model


def _gate_and_up(weight: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate (even) and up (odd) entries of an interleaved gate|up tensor along `dim`."""
    return weight.unflatten(dim, (-1, 2)).unbind(dim + 1)


def _assert_ranks_sum_to_one_device(experts: list[nn.Module], whole: nn.Module, config) -> None:
    """Σ over the ranks' experts of their outputs equals one device's, on tokens routed by the whole router."""
    x = torch.randn(7, config.hidden_size)
    weights, ids = torch.rand(7, 2).softmax(-1), torch.stack([torch.randperm(config.num_local_experts)[:2]
                                                             for _ in range(7)])
    want = whole(x, weights, ids)
    before = [rank_experts.tp.reductions for rank_experts in experts]
    got = sum(rank_experts(x, weights, ids) for rank_experts in experts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [rank_experts.tp.reductions for rank_experts in experts] == [n + 1 for n in before]  # one all-reduce each


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_each_ranks_shard_is_its_slice_and_the_ranks_sum_to_one_device(mxfp4):
    config, tensors = _checkpoint(mxfp4)
    whole = _built(config, tensors)
    ranks = [_built(config, tensors, _rank(r, 2)) for r in range(2)]
    n, heads = INTERMEDIATE // 2, config.num_attention_heads // 2
    for i, layer in enumerate(whole.model.layers):
        full = layer.mlp.experts
        for r, model in enumerate(ranks):
            mine, share = model.model.layers[i].mlp.experts, slice(r * n, (r + 1) * n)
            assert torch.equal(model.model.layers[i].self_attn.sinks, layer.self_attn.sinks[r * heads:(r + 1) * heads])
            if mxfp4:  # [E, 2I, H/32, 16] rows; down [E, H, I/32, 16]: whole blocks of its inputs
                for ours, theirs in zip(_gate_and_up(dequantize_mxfp4(mine.gate_up_proj_blocks,
                                                                      mine.gate_up_proj_scales), 1),
                                        _gate_and_up(dequantize_mxfp4(full.gate_up_proj_blocks,
                                                                      full.gate_up_proj_scales), 1)):
                    assert torch.equal(ours, theirs[:, share])
                assert torch.equal(dequantize_mxfp4(mine.down_proj_blocks, mine.down_proj_scales),
                                   dequantize_mxfp4(full.down_proj_blocks, full.down_proj_scales)[..., share])
            else:  # transformers' [E, H, 2I] and [E, I, H]
                for ours, theirs in zip(_gate_and_up(mine.gate_up_proj, 2), _gate_and_up(full.gate_up_proj, 2)):
                    assert torch.equal(ours, theirs[..., share])
                assert torch.equal(mine.down_proj, full.down_proj[:, share])
            for ours, theirs in zip(_gate_and_up(mine.gate_up_proj_bias, 1), _gate_and_up(full.gate_up_proj_bias, 1)):
                assert torch.equal(ours, theirs[:, share])
            assert torch.equal(mine.down_proj_bias, full.down_proj_bias if r == 0 else torch.zeros_like(
                full.down_proj_bias))  # added once, by the all-reduce
        _assert_ranks_sum_to_one_device([m.model.layers[i].mlp.experts for m in ranks], full, config)


def test_a_rank_share_cutting_an_mxfp4_block_is_refused_naming_the_sizes_that_work():
    """intermediate_size 96 is three blocks: over 2 ranks, 48 inputs of down each."""
    config, _ = _checkpoint(mxfp4=True)
    config.intermediate_size = 96
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_blocks: intermediate_size = 96 "
                                         r"over tensor_parallel_size = 2 would cut its 32-value MXFP4 blocks; "
                                         r"the tensor_parallel_size values that keep them whole: 1, 3"):
        GptOssForCausalLM(config, BACKENDS["exact"], Placement(tp=_rank(0, 2)))
    GptOssExperts(2, 64, 96, 1.702, 7.0, mxfp4=True, tp=_rank(2, 3))  # 32 each: whole blocks


def _block_experts(raw: dict, biases: dict, hidden: int, intermediate: int, tp) -> GptOssGGUFBlockExperts:
    """One layer's GPT-OSS experts from GGUF blocks `raw` (part -> (format, [E, rows, row bytes])) as a
    rank (or one device, `tp` None) holds them, its biases loaded as the loader does."""
    model = nn.Module()
    model.mlp = nn.Module()
    with torch.device("meta"):
        model.mlp.experts = GptOssExperts(next(iter(raw.values()))[1].shape[0], hidden, intermediate, 1.702, 7.0,
                                          tp=tp)
    assert use_block_experts(model, ((f"mlp.experts.{p}", *raw[p]) for p in ("gate", "up", "down"))) == {
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    module = model.mlp.experts
    for name, full in biases.items():
        loader = getattr(getattr(module, name), "weight_loader", None)
        setattr(module, name, nn.Parameter(full if loader is None else loader(full, part=None, expert=None),
                                           requires_grad=False))
    return module


@pytest.mark.skipif(gpt_oss_expert_ops() is None or not hasattr(gpt_oss_expert_ops(), "moe_experts_blocks_gpt_oss"),
                    reason="GPT-OSS's block experts need the native extension")
def test_q8_0_block_experts_shard_by_intermediate_size_and_refuse_a_cut_block():
    """gate, up [E, 128, 64] and down [E, 64, 128] in Q8_0: 64 intermediate entries a rank over 2 (two
    whole blocks of down's inputs), 32 over 4 (one), 16 over 8 (refused, with the way out)."""
    experts, hidden, intermediate, rng = 4, 64, 2 * INTERMEDIATE, np.random.default_rng(0)
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    raw = {part: ("Q8_0", _blocks("Q8_0", experts * rows, cols, rng).reshape(experts, rows, -1))
           for part, (rows, cols) in shapes.items()}
    biases = {"gate_up_proj_bias": torch.randn(experts, 2 * intermediate),
              "down_proj_bias": torch.randn(experts, hidden)}
    whole = _block_experts(raw, biases, hidden, intermediate, None)
    config = SimpleNamespace(hidden_size=hidden, num_local_experts=experts)
    dense = {part: gguf.quants.dequantize(r, gguf.GGMLQuantizationType.Q8_0) for part, (_, r) in raw.items()}
    for size in (2, 4):
        ranks = [_block_experts(raw, biases, hidden, intermediate, _rank(r, size)) for r in range(size)]
        n = intermediate // size
        for r, module in enumerate(ranks):
            share = slice(r * n, (r + 1) * n)
            assert module.intermediate_size == n
            for part, segment in zip(("gate", "up", "down"), module.block_segments):
                held = gguf.quants.dequantize(segment.raw.numpy(), gguf.GGMLQuantizationType.Q8_0)
                np.testing.assert_array_equal(held, dense[part][..., share] if part == "down" else
                                              dense[part][:, share])
            for ours, theirs in zip(_gate_and_up(module.gate_up_proj_bias, 1),
                                    _gate_and_up(biases["gate_up_proj_bias"], 1)):
                assert torch.equal(ours, theirs[:, share])
            assert torch.equal(module.down_proj_bias, biases["down_proj_bias"] if r == 0 else
                               torch.zeros(experts, hidden))
        _assert_ranks_sum_to_one_device(ranks, whole, config)
    with pytest.raises(ValueError, match="mlp.experts.down: 128 columns over 8 ranks are 16 per rank, not whole "
                                         "32-wide Q8_0 GGUF blocks: serve it with --no-quantized-matmul"):
        _block_experts(raw, biases, hidden, intermediate, _rank(0, 8))


# -- over two gloo ranks ---------------------------------------------------------------------------

PARAMS = SamplingParams(temperature=0, max_tokens=8)
ENGINE = dict(num_threads=1, kv_cache_memory="8MiB", max_model_len=128, max_num_batched_tokens=16,
              distributed_timeout_s=120)


def _bf16(path):
    """A bfloat16 checkpoint (the engine, tensor-parallel, runs it in float32) and its float32 reference."""
    save_16bit(GPT_OSS_CONFIGS["gpt_oss"](), torch.bfloat16, path)
    return path, float32_reference(path)


def _mxfp4(path):
    write_mxfp4_checkpoint(path, GPT_OSS_CONFIGS["gpt_oss"](intermediate_size=INTERMEDIATE))
    return path, AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                      dtype=torch.float32).eval()


def _gguf_mxfp4(path):
    (path / "hf").mkdir()
    checkpoint, reference = _mxfp4(path / "hf")
    write_gguf(checkpoint, GPT_OSS_CONFIGS["gpt_oss"](intermediate_size=INTERMEDIATE), path / "model.gguf")
    return path / "model.gguf", reference


def _gguf_q8_0(path):
    config = GPT_OSS_CONFIGS["gpt_oss"](intermediate_size=INTERMEDIATE)
    formats = [{"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}] * config.num_hidden_layers
    return path / "model.gguf", write_block_experts_gguf(path, config, formats)


CHECKPOINTS = {"bf16": _bf16, "mxfp4": _mxfp4, "gguf-mxfp4": _gguf_mxfp4, "gguf-q8_0": _gguf_q8_0}


@pytest.mark.tp_full
@pytest.mark.slow  # rank processes loading the model
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_tp2_gives_tp1_and_transformers_tokens(tmp_path, monkeypatch, checkpoint):
    path, reference = CHECKPOINTS[checkpoint](tmp_path)
    monkeypatch.setenv("BLOCKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    prompts = engine_prompts()
    assert max(map(len, prompts)) > WINDOW
    expected = reference_outputs(reference, prompts, PARAMS.max_tokens)
    tokens = []
    before = child_pids()
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, **ENGINE) as llm:
            layer = llm.engine.core.loaded.model.model.layers[0]  # rank 0's shard
            assert layer.self_attn.sinks.shape == (reference.config.num_attention_heads // size,)
            assert layer.mlp.experts.gate_up_proj_bias.shape[1] == 2 * reference.config.intermediate_size // size
            assert isinstance(layer.mlp.experts, GptOssGGUFBlockExperts) == (checkpoint == "gguf-q8_0")
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)])
    assert not child_pids() - before
    assert tokens[1] == tokens[0]
    assert_greedy_parity(tokens[1], expected)
