"""Tiny random Llama-family models against transformers: same weights, fp32, greedy.

Each model is built from a transformers config at test time, initialised with a large std (so
logits are far from uniform and greedy picks are not near-ties), saved with save_pretrained and
loaded through the real loader; run through the paged scenarios (tests/scenarios.py) over the
suite's backends.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.models.llama import LlamaForCausalLM
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.native.extension import DISABLE_ENV
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs
from tests.scenarios import PAGED_SCENARIOS, SUITE_BACKENDS, paged_prompts

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: generate runs the full length
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "llama3-rope-tied": lambda: LlamaConfig(**SIZES, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2-tied": lambda: Qwen2Config(**SIZES, tie_word_embeddings=True),
    "qwen2-yarn": lambda: Qwen2Config(**SIZES, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=32),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
}
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """A saved random model, the prompts, and transformers' prompt logits and reference outputs."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(CONFIGS[request.param](), path)
    prompts = paged_prompts(SIZES["vocab_size"])
    return path, prompts, reference_logits(reference, prompts), reference_outputs(reference, prompts, NEW_TOKENS)


@pytest.mark.parametrize("scenario", sorted(PAGED_SCENARIOS))
@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_matches_transformers(tiny, backend, scenario):
    path, prompts, ref_logits, reference = tiny
    model = load_model(str(path), BACKENDS[backend]).model
    which, options = PAGED_SCENARIOS[scenario]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=1e-4, rtol=0)
    assert_greedy_parity(tokens, [reference[i] for i in which])


def test_pytorch_paths_match_transformers(tiny, monkeypatch):
    """With native kernels off (no fused ops, gathered decode attention) the same outputs."""
    monkeypatch.setenv(DISABLE_ENV, "0")
    path, prompts, ref_logits, reference = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    assert all(getattr(m, "fused", None) is None and getattr(m, "decode_kernel", None) is None
               for m in [*model.modules(), *(layer.self_attn.attn.backend for layer in model.model.layers)])
    which, options = PAGED_SCENARIOS["batch-of-3"]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=1e-4, rtol=0)
    assert_greedy_parity(tokens, [reference[i] for i in which])


def _tiny_weights(config) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_config(config).state_dict()


def load_model_from_weights(config, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, BACKENDS["exact"])
    model.load_weights(weights.items())
    return model


def test_kv_cache_specs_one_full_attention_layer_each():
    ours = load_model_from_weights(CONFIGS["qwen3"](), _tiny_weights(CONFIGS["qwen3"]()))
    specs = ours.kv_cache_specs(block_size=16)
    assert list(specs) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs.values()} == {(16, 2, 32, "float32")}


def test_load_weights_names_missing_unexpected_and_misshapen_weights():
    config = CONFIGS["llama"]()
    weights = _tiny_weights(config)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weights \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"):
        load_model_from_weights(config, missing)
    with pytest.raises(ValueError, match=r"unexpected weights \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        load_model_from_weights(config, weights | {"model.layers.0.mlp.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected weights \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"):
        load_model_from_weights(config, weights | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    bad = weights | {"model.norm.weight": torch.ones(65)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\).*expects \(64,\)"):
        load_model_from_weights(config, bad)


def test_sliding_window_layers_declare_their_window():
    """An active window makes every layer (Mistral) or the layers `layer_types` marks (Qwen2) a
    sliding-window layer; a window that never bites (>= max_position_embeddings), or no marked
    layer, leaves full attention. (Parity with windows: tests/models/test_dense_families.py.)"""
    def specs(config):
        return set(LlamaForCausalLM(config, BACKENDS["exact"]).kv_cache_specs(4).values())

    assert specs(MistralConfig(**SIZES, sliding_window=32)) == {SlidingWindowSpec(4, 2, 16, "float32", sliding_window=32)}
    assert specs(MistralConfig(**SIZES, sliding_window=SIZES["max_position_embeddings"])) == {
        FullAttentionSpec(4, 2, 16, "float32")}
    qwen2 = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert specs(qwen2) == {FullAttentionSpec(4, 2, 16, "float32")}  # no layer reaches max_window_layers
    qwen2 = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    assert specs(qwen2) == {FullAttentionSpec(4, 2, 16, "float32"), SlidingWindowSpec(4, 2, 16, "float32", sliding_window=32)}
