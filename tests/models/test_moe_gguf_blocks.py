"""A tiny random Qwen3-MoE written as GGUF with gguf-py, its stacked experts in block formats
(layer 0: gate and up Q4_K, down Q6_K; layer 1: all three Q8_0), attention Q4_K, the embedding and head Q6_K,
the router and norms float32: through the real loader its experts run from the file's blocks
(GGUFBlockExperts, csrc/moe_experts.cpp), with no float32 copy and none in the cache; the
weights' resident bytes are the file's tensors' bytes; routing spreads over the experts; greedy
tokens equal transformers' GGUF loader's (which dequantises with gguf-py), whole prefills and
chunked, staggered ones. Without the native kernels the same file loads with its experts
dequantised (moe.Experts) and gives the same tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models import loader
from blockserve.models.gguf_block_experts import GGUFBlockExperts
from blockserve.models.gguf_block_linear import block_resident_bytes
from blockserve.models.loader import load_model
from blockserve.models.moe import Experts, expert_ops
from blockserve.models.weight_memory import resident_weight_bytes
from tests.models.test_gguf_block_linear import random_blocks
from tests.paged_harness import run_paged
from tests.parity import greedy_tokens, reference_outputs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(expert_ops() is None, reason="the block experts need the native extension")]

# EXPERT_FFN 768: transformers' GGUF loader does not read expert_feed_forward_length (it keeps its default, 768)
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, EXPERT_FFN, LAYERS = 512, 256, 4, 2, 64, 8, 2, 768, 2
NEW_TOKENS = 8
EXPERT_FORMATS = [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}]
TYPICAL_LEVELS = {"Q4_K": 240.0, "Q6_K": 1000.0, "Q8_0": 64.0}  # scale -> weights of about 0.05


def _blocks(format: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    return random_blocks(format, rows, columns, rng, rng.uniform(0.5, 1.5, 64) * 0.05 / TYPICAL_LEVELS[format])


def write_qwen3_moe_gguf(path, seed: int = 0) -> int:
    """The model above, written as llama.cpp lays a qwen3moe GGUF out; returns its tensors' bytes."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for add, value in ((writer.add_context_length, 256), (writer.add_block_count, LAYERS),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, 512),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
                       (writer.add_expert_count, EXPERTS), (writer.add_expert_used_count, TOP_K),
                       (writer.add_expert_feed_forward_length, EXPERT_FFN)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges([])
    tensors = {"token_embd.weight": ("Q6_K", VOCAB, HIDDEN), "output.weight": ("Q6_K", VOCAB, HIDDEN),
               "output_norm.weight": ("F32", HIDDEN)}
    for i in range(LAYERS):
        tensors.update({
            f"blk.{i}.attn_norm.weight": ("F32", HIDDEN), f"blk.{i}.ffn_norm.weight": ("F32", HIDDEN),
            f"blk.{i}.attn_q_norm.weight": ("F32", HEAD_DIM), f"blk.{i}.attn_k_norm.weight": ("F32", HEAD_DIM),
            f"blk.{i}.attn_q.weight": ("Q4_K", HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": ("Q4_K", KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": ("Q4_K", KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": ("Q4_K", HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate_inp.weight": ("F32", EXPERTS, HIDDEN),
            **{f"blk.{i}.ffn_{part}_exps.weight": (format, EXPERTS, *((HIDDEN, EXPERT_FFN) if part == "down" else
                                                                      (EXPERT_FFN, HIDDEN)))
               for part, format in EXPERT_FORMATS[i].items()},
        })
    total = 0
    for name, (format, *shape) in tensors.items():
        if format == "F32":
            scale = 1.0 if name.endswith("ffn_gate_inp.weight") else 0.1
            data = (1.0 + 0.1 * rng.standard_normal(shape)) if name.endswith("norm.weight") else \
                scale * rng.standard_normal(shape)
            data = data.astype(np.float32)
            writer.add_tensor(name, data)
        else:
            *outer, columns = shape
            data = _blocks(format, int(np.prod(outer)), columns, rng).reshape(*outer, -1)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[format])
        total += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """(directory, GGUF path, its tensors' bytes, transformers' greedy tokens for PROMPTS)."""
    directory = tmp_path_factory.mktemp("qwen3moe_gguf")
    path = directory / "model.gguf"
    file_bytes = write_qwen3_moe_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=path.name, dtype=torch.float32)
    return directory, path, file_bytes, greedy_tokens(reference_outputs(reference, PROMPTS, NEW_TOKENS))


PROMPTS = [np.random.default_rng(1).integers(0, VOCAB, n).tolist() for n in (5, 23, 11)]


def test_experts_run_from_the_files_blocks_as_transformers(model_file):
    directory, path, file_bytes, want = model_file
    model = load_model(str(path), BACKENDS["exact"], cache_dir=str(directory / "cache")).model
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(e, GGUFBlockExperts) for e in experts)
    assert [[s.format for s in e.block_segments] for e in experts] == [list(f.values()) for f in EXPERT_FORMATS]
    assert all(p.dim() < 3 for p in model.parameters()), "a float32 expert stack is resident"
    expert_bytes = sum(e.resident_bytes() for e in experts)
    assert block_resident_bytes(model)["Q8_0"] >= expert_bytes // 3  # layer 1's experts counted by format
    resident = sum(resident_weight_bytes(model).values())
    assert abs(resident - file_bytes) <= 0.1 * file_bytes, (resident, file_bytes)
    # config and tokenizer from the metadata (gguf_config.py), every tensor from the file: nothing cached
    assert not loader.gguf_cache_entry(path, directory / "cache").exists()

    picked: dict[int, list[torch.Tensor]] = {}
    hooks = [e.register_forward_hook(lambda module, args, out, i=i: picked.setdefault(i, []).append(args[2]))
             for i, e in enumerate(experts)]
    try:
        for chunk, stagger in ((None, False), (4, True)):
            _, tokens = run_paged(model, PROMPTS, NEW_TOKENS, chunk=chunk, stagger=stagger)
            assert tokens == want, (chunk, stagger)
    finally:
        for hook in hooks:
            hook.remove()
    for i, ids in picked.items():  # the routing spreads: the parity covers half the experts or more, not one
        assert len(torch.cat([t.flatten() for t in ids]).unique()) >= EXPERTS // 2, i


def test_without_native_kernels_the_experts_are_dequantised(model_file, monkeypatch):
    directory, path, _, want = model_file
    monkeypatch.setenv("BLOCKSERVE_NATIVE_KERNELS", "0")
    model = load_model(str(path), BACKENDS["exact"], cache_dir=str(directory / "cache")).model
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is Experts and experts.gate_up_proj.shape == (EXPERTS, 2 * EXPERT_FFN, HIDDEN)
    _, tokens = run_paged(model, PROMPTS, NEW_TOKENS)
    assert tokens == want


def test_int8_activations_reach_the_experts(model_file):
    """--quantized-activations int8 runs the experts on int8 dots as it does the dense layers."""
    directory, path, _, _ = model_file
    model = load_model(str(path), BACKENDS["exact"], cache_dir=str(directory / "cache"),
                       quantized_activations="int8").model
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert [e.activations for e in experts] == ["int8"] * LAYERS
    gen = torch.Generator().manual_seed(3)
    x, ids = torch.randn(3, HIDDEN, generator=gen), torch.rand(3, EXPERTS, generator=gen).topk(TOP_K).indices
    weights = torch.full((3, TOP_K), 1 / TOP_K)
    blocks = [a for s in experts[0].block_segments for a in (s.raw, s.format)]
    with torch.no_grad():
        out = experts[0](x, weights, ids)
    assert torch.equal(out, expert_ops().moe_experts_blocks(x, weights, ids, *blocks, EXPERT_FFN, "int8"))
    assert not torch.equal(out, expert_ops().moe_experts_blocks(x, weights, ids, *blocks, EXPERT_FFN, "float32"))
