"""Mixtral, Qwen2-MoE and Qwen3-MoE from GGUF files written here with gguf-py as llama.cpp's converter
lays them out: architectures "llama" (with experts: Mixtral, Q and K rows permuted for llama.cpp's
rope), "qwen2moe" and "qwen3moe"; the router `ffn_gate_inp`, stacked experts `ffn_{gate,up,down}_exps`
[E, rows, columns], the shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp` [H]; the
routing llama.cpp fixes per architecture (Qwen3-MoE renormalises, Qwen2-MoE does not) and no dense
layers. Float32 tensors: the converted model's parameters equal those loaded from the Hugging Face
directory, its logits theirs up to float32 rounding (measured: 0, or up to 3e-6 for Qwen2-MoE), and
its greedy tokens transformers'.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.test_moe_families import MOE_CONFIGS
from tests.paged_harness import run_paged
from tests.parity import greedy_tokens, reference_outputs
from tests.scenarios import paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _llama_cpp_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of a "llama" GGUF's Q and K rows: per head, the rotary halves interleaved."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _gguf_tensors(reference, arch: str):
    """(GGUF name, float32 array) of transformers' state_dict, as llama.cpp's converter names them."""
    config = reference.config
    for name, tensor in reference.state_dict().items():
        weights = tensor.detach().float().numpy()
        module, _, leaf = name.rpartition(".")
        if module in _TOP:
            yield f"{_TOP[module]}.{leaf}", weights
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> gate, up [E, I, H]
            gate, up = np.split(weights, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
            continue
        if rest == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", weights
            continue
        module, _, leaf = rest.rpartition(".")
        kind = _LAYER[module]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            weights = _llama_cpp_rope_rows(
                weights, config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads)
        if kind == "ffn_gate_inp_shexp":
            weights = weights.reshape(-1)  # llama.cpp stores the shared expert's gate as a vector
        yield f"blk.{layer}.{kind}.{leaf}", weights


def write_gguf(reference, path, arch: str) -> None:
    """A float32 GGUF of `reference` with llama.cpp's metadata and a placeholder vocabulary."""
    config = reference.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_used_count(config.num_experts_per_tok)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_expert_count(config.num_local_experts)
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    for name, weights in _gguf_tensors(reference, arch):
        writer.add_tensor(name, np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_gguf_loads_as_the_safetensors_model(tmp_path, name):
    config = MOE_CONFIGS[name]()
    if name != "mixtral":  # llama.cpp's Qwen MoE graphs have no dense layers
        config.mlp_only_layers, config.decoder_sparse_step = [], 1
    reference = save_random_model(config, tmp_path / "hf")
    write_gguf(reference, tmp_path / "model.gguf", GGUF_ARCH[name])
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(tmp_path / "hf"), BACKENDS["exact"])
    assert type(from_gguf.model) is type(from_dir.model)
    ours, theirs = dict(from_gguf.model.named_parameters()), dict(from_dir.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    for key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "num_local_experts", "num_experts", "mlp_only_layers", "decoder_sparse_step"):
        assert getattr(from_gguf.hf_config, key, None) == getattr(from_dir.hf_config, key, None), key
    prompts = paged_prompts()
    gguf_logits, gguf_tokens = run_paged(from_gguf.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    dir_logits, dir_tokens = run_paged(from_dir.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    for ours, theirs in zip(gguf_logits, dir_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # equal weights; float32 rounding
    assert gguf_tokens == dir_tokens == greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))
