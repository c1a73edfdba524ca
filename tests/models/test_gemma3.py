"""Gemma 3 (local sliding-window + global layers) on tiny random configs against transformers.

The paged harness runs the model with one block table and one `AttentionMetadata` per KV group,
as the engine does, and releases sliding-window blocks as they leave the window: their memory is
filled with NaN and their table entry points at the null block, so a backend that read outside
the window would show it in the logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig

from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.kv.capacity import plan_kv_cache
from blockserve.models.gemma3 import Gemma3ForCausalLM
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs
from tests.scenarios import SUITE_BACKENDS

S, F = "sliding_attention", "full_attention"
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             query_pre_attn_scalar=24, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
CONFIGS = {
    # Gemma 3 4B-like: 5 local per global, linear rope scaling on the global layers only, tied embeddings.
    "w8-linear-rope": lambda: Gemma3TextConfig(
        **SIZES, num_hidden_layers=6, num_key_value_heads=2, sliding_window=8, layer_types=[S] * 5 + [F],
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                         F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}),
    # A window that is no multiple of the block size, final logit soft-capping, untied lm_head,
    # one KV head, attention bias, and a global layer first.
    "w13-softcap-untied": lambda: Gemma3TextConfig(
        **SIZES, num_hidden_layers=4, num_key_value_heads=1, sliding_window=13, layer_types=[F, S, S, F],
        final_logit_softcapping=30.0, tie_word_embeddings=False, attention_bias=True),
}
NEW_TOKENS = 10


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 11, 22, 31)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(model path, transformers reference, (its prompt logits, its reference_outputs))."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(CONFIGS[request.param](), path)
    return path, reference, (reference_logits(reference, prompts()), reference_outputs(reference, prompts(), NEW_TOKENS))


@pytest.mark.parametrize("backend", SUITE_BACKENDS)
@pytest.mark.parametrize("mode", ["whole-prompt", "chunked-staggered"])
def test_logits_and_greedy_match_transformers(tiny, backend, mode):
    path, _, (ref_logits, ref_outputs) = tiny
    loaded = load_model(str(path), BACKENDS[backend])
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    options = dict(chunk=5, stagger=True) if mode == "chunked-staggered" else {}
    logits, generated = run_paged(loaded.model, prompts(), NEW_TOKENS, **options)
    worst = assert_logits_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert_greedy_parity(generated, ref_outputs)  # no near-tie occurs here: equality
    print(f"max |logit - transformers| = {worst:.2e}")


def test_two_groups_with_different_specs(tiny):
    path, reference, _ = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    specs = model.kv_cache_specs(4)
    config = reference.config
    for i, layer_type in enumerate(config.layer_types):
        spec = specs[f"model.layers.{i}.self_attn"]
        if layer_type == S:
            assert spec == SlidingWindowSpec(4, config.num_key_value_heads, 16, "float32",
                                             sliding_window=config.sliding_window)
        else:
            assert type(spec) is FullAttentionSpec
    assert len(set(specs.values())) == 2


def _config(**overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 2, "num_key_value_heads": 2, "sliding_window": 8,
                               "layer_types": [S, F], **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                           F: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}), "dynamic"),
])
def test_unsupported_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM(_config(**overrides), BACKENDS["exact"])


def test_metadata_without_the_window_is_refused(tiny):
    """A caller that gives a sliding layer full-attention metadata gets an error, not wrong logits."""
    path, _, _ = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    specs = model.kv_cache_specs(4)
    caches = {n: LayerCache(0, torch.zeros(3, 4, s.num_kv_heads, s.head_size),
                            torch.zeros(3, 4, s.num_kv_heads, s.head_size)) for n, s in specs.items()}
    layout = BatchLayout.build([3], [0])
    meta = AttentionMetadata.build(layout, torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="sliding_window"):
        model(torch.tensor([1, 2, 3]), layout.positions, ForwardContext(caches, [meta]))


# -- memory -------------------------------------------------------------------------------------

def concurrent_long_requests(specs: dict, memory_bytes: int, max_model_len: int, chunk: int) -> int:
    """How many decoding requests of `max_model_len` tokens fit at once in the pools that
    `plan_kv_cache` builds from `memory_bytes` for prefill chunks of up to `chunk` tokens."""
    groups: dict = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    config = plan_kv_cache([(spec, tuple(names), False) for spec, names in groups.items()], memory_bytes,
                           max_model_len, max_num_seqs=256, max_chunk_tokens=chunk)
    return min((g.num_blocks - 1) // g.spec.max_blocks_held(max_model_len, 1) for g in config.groups)


def test_sliding_layers_serve_more_long_requests_than_all_global(capsys):
    """The Gemma 3 layout (5 local : 1 global, window 1024) against the same model with every
    layer global, in the same KV memory, for requests of 8192 tokens. Prints the ratios: the
    pools are planned for the longest prefill chunk, so a smaller chunk cap leaves more room."""
    block_size, window, max_model_len, memory = 16, 1024, 8192, 2**30
    config = Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 12, "num_key_value_heads": 2,
                                 "sliding_window": window, "max_position_embeddings": max_model_len,
                                 "layer_types": ([S] * 5 + [F]) * 2})
    gemma = Gemma3ForCausalLM(config, BACKENDS["exact"]).kv_cache_specs(block_size)
    all_global = {name: FullAttentionSpec(block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
                  for name, spec in gemma.items()}
    # What one decoding request holds, in layer-blocks: the ratio an ideal split would reach.
    ideal = (sum(s.max_blocks_held(max_model_len, 1) for s in all_global.values())
             / sum(s.max_blocks_held(max_model_len, 1) for s in gemma.values()))
    lines = []
    for chunk in (1, 256, 2048):  # 2048: the engine's default max_num_batched_tokens
        hybrid = concurrent_long_requests(gemma, memory, max_model_len, chunk)
        full = concurrent_long_requests(all_global, memory, max_model_len, chunk)
        lines.append(f"prefill chunk cap {chunk:4}: Gemma 3 layout {hybrid:3}, all global {full:3}, "
                     f"x{hybrid / full:.2f}")
        assert full >= 1 and hybrid > full
        if chunk == 1:
            assert math.isclose(hybrid / full, ideal, rel_tol=0.1)
    with capsys.disabled():
        print(f"\n  concurrent {max_model_len}-token requests in {memory >> 20} MiB of KV "
              f"(12 layers, window {window}, block {block_size}; ideal x{ideal:.2f}):")
        for line in lines:
            print("   ", line)
