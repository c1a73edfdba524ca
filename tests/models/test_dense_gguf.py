"""Phi-3, Gemma 2, Granite, OLMo 2, GLM-4, SmolLM3 and EXAONE 4 from GGUF files written here with gguf-py
as llama.cpp's converter lays them out: tensor names from gguf-py's own table (gguf.get_tensor_name_map,
the converter's), so Phi-3's fused `attn_qkv` and `ffn_up` (gate | up, as GLM-4's), Gemma 2's
`post_attention_norm`, `ffn_norm` (its pre-feed-forward norm) and `post_ffw_norm`, OLMo 2's and EXAONE 4's
post-norms and q/k norms, GLM-4's sandwich norms; Gemma's norm weights stored as 1 + w; Q and K rows
permuted for the converter's LlamaModel lineage (Granite, SmolLM3); the metadata the converter writes
(sliding window and EXAONE 4's per-layer pattern, rotary dimensions, soft caps, Granite's multipliers as
float32) and Phi-3's LongRoPE factors as its `rope_factors_long` / `rope_factors_short` tensors with
rope.scaling.original_context_length (here Phi-4-mini's shape: partial rotary, tied embeddings).
transformers' own GGUF loader reads none of Granite, OLMo 2, GLM-4, SmolLM3 and EXAONE 4, so each family
is compared with the safetensors load of the same weights: parameters and config equal (Gemma 2's norms up
to the float32 rounding of 1 + w), logits equal up to float32 rounding, greedy tokens transformers'. GGUF
architectures blockserve does not read (Gemma 3 here) are refused with a message naming them.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from transformers import (Exaone4Config, Gemma2Config, Gemma3TextConfig, Glm4Config, GraniteConfig, LlamaConfig,
                          Olmo2Config, Phi3Config, Qwen3Config, SmolLM3Config)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.paged_harness import run_paged
from tests.parity import greedy_tokens, reference_outputs
from tests.scenarios import paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
S, F = "sliding_attention", "full_attention"
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
DENSE_GGUF_CONFIGS = {
    "phi3": lambda: Phi3Config(**_COMMON, num_hidden_layers=2, sliding_window=9),
    "gemma2": lambda: Gemma2Config(**{**_COMMON, "intermediate_size": 128}, num_hidden_layers=3, head_dim=16,
                                   layer_types=[S, F, S], sliding_window=7, query_pre_attn_scalar=16,
                                   attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
    "granite": lambda: GraniteConfig(**_COMMON, num_hidden_layers=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                                     attention_multiplier=0.2, logits_scaling=1.5, attention_bias=True),
    "olmo2": lambda: Olmo2Config(**_COMMON, num_hidden_layers=2),
    "glm4": lambda: Glm4Config(**_COMMON, num_hidden_layers=2, head_dim=16),
    # NoPE on every fourth layer: llama.cpp's fixed step, transformers' default
    "smollm3": lambda: SmolLM3Config(**_COMMON, num_hidden_layers=4),
    # Phi-4-mini's shape: LongRoPE over 3/4 of each head, tied embeddings (factors exact in float32)
    "phi3-longrope": lambda: Phi3Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                        original_max_position_embeddings=ORIGINAL, rope_parameters=LONG_ROPE),
    # local layers with RoPE, a global one without (its window pattern: one flag a layer)
    "exaone4": lambda: Exaone4Config(**_COMMON, num_hidden_layers=3, head_dim=16, sliding_window=7,
                                     layer_types=[S, S, F]),
    # EXAONE 4.0-1.2B's shape: no window, every layer global with RoPE
    "exaone4-global": lambda: Exaone4Config(**_COMMON, num_hidden_layers=2, head_dim=16, sliding_window=None,
                                            layer_types=[F, F]),
    # config and tokenizer read without transformers (gguf_config.py); head_dim its default, as in the file
    "qwen3": lambda: Qwen3Config(**_COMMON, num_hidden_layers=2),
}
ORIGINAL = 64
LONG_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
             "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.125 * i for i in range(6)],
             "long_factor": [2.0 + 0.5 * i for i in range(6)]}
GGUF_ARCH = {"phi3": gguf.MODEL_ARCH.PHI3, "phi3-longrope": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
             "granite": gguf.MODEL_ARCH.GRANITE, "olmo2": gguf.MODEL_ARCH.OLMO2, "glm4": gguf.MODEL_ARCH.GLM4,
             "smollm3": gguf.MODEL_ARCH.SMOLLM3, "exaone4": gguf.MODEL_ARCH.EXAONE4,
             "exaone4-global": gguf.MODEL_ARCH.EXAONE4, "qwen3": gguf.MODEL_ARCH.QWEN3}
GGUF_ARCH["llama"] = gguf.MODEL_ARCH.LLAMA  # the rope_freqs test's
# the converter's LlamaModel lineage permutes Q and K rows (weights and biases)
ROPE_PERMUTED = {"granite", "smollm3", "llama"}
NORMS_PLUS_ONE = {"gemma2"}  # llama.cpp's converter stores Gemma's norm weights as 1 + w
# the config fields a GGUF's metadata carries, beyond the shapes
CONFIG_KEYS = ("sliding_window", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping", "layer_types", "tie_word_embeddings", "rope_parameters",
               "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
               "attention_bias", "mlp_bias", "no_rope_layers", "use_sliding_window", "original_max_position_embeddings")


def _llama_cpp_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of Q and K rows: per head, the rotary halves interleaved."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _gguf_tensors(reference, name: str):
    """(GGUF name, float32 array) of transformers' state_dict, named by gguf-py's converter table."""
    config = reference.config
    names = gguf.get_tensor_name_map(GGUF_ARCH[name], config.num_hidden_layers)
    for key, tensor in reference.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the converter writes no output tensor for tied embeddings
        weights = tensor.detach().float().numpy()
        if name in NORMS_PLUS_ONE and key.endswith("norm.weight"):
            weights = weights + np.float32(1)
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, key
        kind = gguf_name.split(".")[-2]
        if name in ROPE_PERMUTED and kind in ("attn_q", "attn_k"):
            weights = _llama_cpp_rope_rows(
                weights, config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads)
        yield gguf_name, weights


def write_gguf(reference, path, name: str, edit=None) -> None:
    """A float32 GGUF of `reference` with the metadata llama.cpp's converter writes and a placeholder
    vocabulary; `edit(writer)`, where given, adds to it before it is written."""
    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[GGUF_ARCH[name]])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if name == "phi3":
        writer.add_rope_dimension_count(head_dim)
    if name == "phi3-longrope":  # the converter: its rotary dimensions, original length and factor tensors
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        writer.add_sliding_window(0)  # the converter's "no window"
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if name.startswith("exaone4"):  # the converter writes the pattern with a window only
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if config.sliding_window:
            writer.add_sliding_window_pattern([kind == S for kind in config.layer_types])
    if name in ROPE_PERMUTED:  # the converter's LlamaModel writes the rotary dimensions
        writer.add_rope_dimension_count(head_dim)
    if name == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if name == "glm4":  # the converter: rotary dimensions = head_dim * partial_rotary_factor
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if name == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    for gguf_name, weights in _gguf_tensors(reference, name):
        writer.add_tensor(gguf_name, np.ascontiguousarray(weights))
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", sorted(DENSE_GGUF_CONFIGS))
def test_gguf_loads_as_the_safetensors_model(tmp_path, name):
    reference = save_random_model(DENSE_GGUF_CONFIGS[name](), tmp_path / "hf")
    write_gguf(reference, tmp_path / "model.gguf", name)
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(tmp_path / "hf"), BACKENDS["exact"])
    assert type(from_gguf.model) is type(from_dir.model)
    ours, theirs = dict(from_gguf.model.named_parameters()), dict(from_dir.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for key in ours:
        want = theirs[key]
        if name in NORMS_PLUS_ONE and key.endswith("norm.weight"):
            want = (want + 1) - 1  # stored as 1 + w: w up to that float32 rounding
        assert torch.equal(ours[key], want), key
    for key in CONFIG_KEYS:
        want = getattr(from_dir.hf_config, key, None)
        if isinstance(want, float):
            want = float(np.float32(want))  # GGUF metadata holds float32
        assert getattr(from_gguf.hf_config, key, None) == want, key
    prompts = paged_prompts()
    gguf_logits, gguf_tokens = run_paged(from_gguf.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    dir_logits, dir_tokens = run_paged(from_dir.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    for ours, theirs in zip(gguf_logits, dir_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # equal weights; float32 rounding
    assert gguf_tokens == dir_tokens == greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPE_FREQS_CONFIGS = {  # EXAONE 4.0-32B's and Llama 3.1's scaling, which the converter writes as rope_freqs
    "exaone4": lambda: Exaone4Config(**_COMMON, num_hidden_layers=2, head_dim=16, sliding_window=None,
                                     layer_types=[F, F], rope_parameters=LLAMA3_ROPE),
    "llama": lambda: LlamaConfig(**_COMMON, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE),
}


@pytest.mark.parametrize("name", sorted(ROPE_FREQS_CONFIGS))
def test_rope_freqs_divide_the_rotary_frequencies(tmp_path, name):
    """llama.cpp's converter writes llama3 scaling as a rope_freqs tensor of per-dimension divisors
    (and plain RoPE metadata): loaded, the GGUF runs as transformers' llama3 RoPE does."""
    reference = save_random_model(ROPE_FREQS_CONFIGS[name](), tmp_path / "hf")
    head_dim = 16
    plain = 1.0 / LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](reference.config, device="cpu")
    divisors = (plain / scaled).numpy()
    assert (divisors > 1).any()  # the scaling changes the low frequencies
    write_gguf(reference, tmp_path / "model.gguf", name,
               edit=lambda writer: writer.add_tensor("rope_freqs.weight", divisors))
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(tmp_path / "hf"), BACKENDS["exact"])
    assert from_gguf.hf_config.rope_freq_divisors == [float(d) for d in divisors]
    prompts = paged_prompts()
    gguf_logits, gguf_tokens = run_paged(from_gguf.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    dir_logits, dir_tokens = run_paged(from_dir.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    for ours, theirs in zip(gguf_logits, dir_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # divided, not scaled: float32 rounding
    assert gguf_tokens == dir_tokens == greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))


def test_an_architecture_not_read_is_refused_by_name(tmp_path):
    reference = save_random_model(Gemma3TextConfig(**_COMMON, num_hidden_layers=1), tmp_path / "hf")
    writer = gguf.GGUFWriter(tmp_path / "model.gguf", "gemma3")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(reference.config.vocab_size)])
    for key, tensor in reference.state_dict().items():
        gguf_name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 1).get_name(key, try_suffixes=(".weight",))
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor.detach().float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not from a GGUF file of architecture 'gemma3'.*phi3, gemma2"):
        load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
