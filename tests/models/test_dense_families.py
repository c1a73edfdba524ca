"""Tiny random dense families against transformers: Mistral and Qwen2 with sliding windows, Gemma 2,
Phi-3 / Phi-4-mini, OLMo 2, Granite 3.x, SmolLM3, GLM-4, EXAONE 4.

Each is built from a transformers config at test time, initialised far from uniform logits, saved
with save_pretrained and loaded through the real loader; run through paged attention blocks with
NaN in every unused block (tests/paged_harness.py), whole prompts and staggered chunks, over the
suite's backends. The sliding-window families have windows of 6 to 10 tokens (none a multiple of
the 4-token block) and prompts of up to 31 tokens: their blocks leave the window (poisoned,
released) mid-prompt. Prompt logits within 1e-4 of transformers' (float32; the largest difference
measured is 2.3e-5, Gemma 2), greedy tokens equal.
The engine scenarios (prefix caching, chunked prefill, preemption, log-probabilities):
tests/engine/test_families_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Exaone4Config,
    Gemma2Config,
    Glm4Config,
    GraniteConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    SmolLM3Config,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.triton_attention import TritonAttention
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.models.llama import rotary_dim_of
from blockserve.models.loader import load_model
from blockserve.models.placement import Placement
from blockserve.models.random_checkpoint import save_random_model
from blockserve.models.registry import model_class
from blockserve.models.rotary import RotaryEmbedding
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs
from tests.scenarios import SUITE_BACKENDS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S, F = "sliding_attention", "full_attention"
NEW_TOKENS = 10
LOGIT_TOLERANCE = 1e-4  # absolute, float32
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


ORIGINAL = 64  # LongRoPE's original_max_position_embeddings in the Phi configs


def _longrope(rotary_dim: int, original: int) -> dict:
    """LongRoPE parameters (Phi-3 128k / Phi-4-mini) with distinct short and long factors per frequency."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}


DENSE_CONFIGS = {
    # a window on every layer
    "mistral-window": lambda: MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=10),
    # a window on the layers from max_window_layers on (layer_types), full attention below
    "qwen2-window": lambda: Qwen2Config(**_COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=7,
                                        max_window_layers=1),
    # soft-capped attention (a cap the scores reach) and logits, sliding / full layers, 4 norms per layer
    "gemma2": lambda: Gemma2Config(**{**_COMMON, "intermediate_size": 128}, num_hidden_layers=3, head_dim=16,
                                   layer_types=[S, F, S], sliding_window=7, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
    # LongRoPE and a sliding window. Sequences stay within the original length (64), where transformers
    # uses the short factors; the long factors: test_longrope_table_matches_transformers
    "phi3-longrope-window": lambda: Phi3Config(**_COMMON, num_hidden_layers=2, sliding_window=9,
                                               original_max_position_embeddings=ORIGINAL,
                                               rope_parameters=_longrope(16, ORIGINAL)),
    # Phi-4-mini: partial rotary (3/4 of each head) with LongRoPE, tied embeddings
    "phi4-mini-partial": lambda: Phi3Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                            original_max_position_embeddings=ORIGINAL,
                                            rope_parameters={**_longrope(12, ORIGINAL), "partial_rotary_factor": 0.75}),
    # post-norms, q/k norms over the whole projection
    "olmo2": lambda: Olmo2Config(**_COMMON, num_hidden_layers=2),
    # muP multipliers, attention bias
    "granite": lambda: GraniteConfig(**_COMMON, num_hidden_layers=2, embedding_multiplier=2.0,
                                     residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
                                     attention_bias=True),
    # NoPE on every second layer, which also slides (use_sliding_window)
    "smollm3": lambda: SmolLM3Config(**_COMMON, num_hidden_layers=4, no_rope_layer_interval=2,
                                     use_sliding_window=True, sliding_window=6),
    # sandwich norms, interleaved partial RoPE (half of each head), q/k/v bias
    "glm4": lambda: Glm4Config(**_COMMON, num_hidden_layers=2, head_dim=16),
    # post-norms, per-head q/k norms, sliding layers with RoPE, global layers without
    "exaone4": lambda: Exaone4Config(**_COMMON, num_hidden_layers=4, head_dim=16, sliding_window=10,
                                     sliding_window_pattern=2),
}


def architecture(name: str) -> str:
    """The `architectures` name transformers saves for DENSE_CONFIGS[name]."""
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[DENSE_CONFIGS[name]().model_type]


def prompts() -> list[list[int]]:
    """Four prompts of 3 to 31 tokens: the longest three outgrow every window above."""
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 11, 22, 31)]


@pytest.fixture(scope="module", params=sorted(DENSE_CONFIGS))
def dense(request, tmp_path_factory):
    """(name, model path, transformers reference, its reference_logits, its reference_outputs)."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(DENSE_CONFIGS[request.param](), path)
    return (request.param, path, reference, reference_logits(reference, prompts()),
            reference_outputs(reference, prompts(), NEW_TOKENS))


@pytest.mark.parametrize("backend", SUITE_BACKENDS)
@pytest.mark.parametrize("mode", ["whole-prompt", "chunked-staggered"])
def test_logits_and_greedy_match_transformers(dense, backend, mode):
    name, path, _, want_logits, expected = dense
    loaded = load_model(str(path), BACKENDS[backend])
    assert isinstance(loaded.model, model_class([architecture(name)]))
    options = dict(chunk=5, stagger=True) if mode == "chunked-staggered" else {}
    logits, generated = run_paged(loaded.model, prompts(), NEW_TOKENS, **options)
    worst = assert_logits_close(logits, want_logits, atol=LOGIT_TOLERANCE, rtol=0)
    assert_greedy_parity(generated, expected)
    print(f"{name}: max |logit - transformers| = {worst:.1e}")


def test_sliding_layers_declare_their_window(dense):
    """Each layer's KV spec carries the window transformers' mask gives that layer."""
    name, path, reference, _, _ = dense
    config = reference.config
    specs = load_model(str(path), BACKENDS["exact"]).model.kv_cache_specs(4)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or [S if window else F] * len(specs)
    for i, layer_type in enumerate(layer_types):
        spec = specs[f"model.layers.{i}.self_attn"]
        if layer_type == S and window:
            assert spec == SlidingWindowSpec(4, 2, spec.head_size, "float32", sliding_window=window)
        else:
            assert type(spec) is FullAttentionSpec, (name, i, spec)


@pytest.mark.parametrize("name", ["phi3-longrope-window", "phi4-mini-partial"])
def test_longrope_table_matches_transformers(name):
    """The rotary table by position: below the original length transformers' short-factor cos/sin (its
    rotary over a sequence within that length), from it on its long-factor ones (over a longer one).
    transformers' generate recomputes a sequence that grows past the original length entirely with
    the long factors; blockserve keeps the keys it computed (llama.py), so parity holds up to there."""
    config = DENSE_CONFIGS[name]()
    head_dim = config.hidden_size // config.num_attention_heads
    table = RotaryEmbedding(config, rotary_dim_of(config, head_dim), Placement())
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    short_cos, short_sin = theirs(x, torch.arange(ORIGINAL)[None])
    long_cos, long_sin = theirs(x, torch.arange(config.max_position_embeddings)[None])
    half = table.cos.shape[-1]  # rotary_dim / 2: Phi-4-mini rotates 12 of its 16 dims
    torch.testing.assert_close(table.cos[:ORIGINAL], short_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin[:ORIGINAL], short_sin[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.cos[ORIGINAL:], long_cos[0, ORIGINAL:, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin[ORIGINAL:], long_sin[0, ORIGINAL:, :half], rtol=0, atol=1e-6)
    assert not torch.allclose(long_cos[0, :ORIGINAL], short_cos[0])  # the two regimes differ


@pytest.mark.parametrize("dense", ["gemma2"], indirect=True)
def test_gemma2_parity_needs_the_attention_softcap(dense):
    """The soft-cap is live in the Gemma 2 config: without it the logits leave the tolerance."""
    _, path, _, want_logits, _ = dense
    model = load_model(str(path), BACKENDS["exact"]).model
    for layer in model.model.layers:
        layer.self_attn.attn.backend.softcap = None
    logits, _ = run_paged(model, prompts(), 1)
    assert max(float((ours - theirs).abs().max()) for ours, theirs in zip(logits, want_logits)) > 100 * LOGIT_TOLERANCE


def test_soft_capping_is_never_dropped(tmp_path):
    """The native decode kernel cannot soft-cap: a soft-capping exact backend leaves it unused, and the
    triton backend, which cannot either, refuses the model."""
    save_random_model(DENSE_CONFIGS["gemma2"](), tmp_path)
    model = load_model(str(tmp_path), BACKENDS["exact"]).model
    assert all(layer.self_attn.attn.backend.decode_kernel is None and layer.self_attn.attn.backend.softcap == 3.0
               for layer in model.model.layers)
    with pytest.raises(ValueError, match="'triton' does not soft-cap"):
        load_model(str(tmp_path), TritonAttention)


@pytest.mark.parametrize("dense", ["gemma2"], indirect=True)
def test_flex_soft_caps_as_a_score_mod(dense):
    """The flex backend (whose full matrix is deselected by default) soft-caps too: one long prompt's
    logits and greedy tokens."""
    _, path, _, want_logits, expected = dense
    model = load_model(str(path), BACKENDS["flex"]).model
    assert all(layer.self_attn.attn.backend.score_mod is not None for layer in model.model.layers)
    logits, generated = run_paged(model, prompts()[3:], NEW_TOKENS, chunk=9)
    assert_logits_close(logits, want_logits[3:], atol=LOGIT_TOLERANCE, rtol=0)
    assert_greedy_parity(generated, expected[3:])


def test_olmo2_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor parallelism"):
        model_class(["Olmo2ForCausalLM"]).check_tensor_parallel(2)
