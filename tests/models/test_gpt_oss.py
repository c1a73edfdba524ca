"""A tiny random GPT-OSS against transformers: attention sinks, sliding-window and full layers
alternating (a window of 8 tokens, shorter than the longer prompts), YaRN rotary, the top-k-then-softmax
router, the clamped SwiGLU experts with biases.

Built from a config at test time (8 experts, top-2), saved with save_pretrained and loaded through the
real loader; run through paged attention blocks with NaN in every unused block (tests/paged_harness.py).
Prompt logits within 1e-4 of transformers' eager attention (which adds the sinks), greedy tokens equal.
The sinks are live (zeroing them breaks parity), routing spreads (every MoE layer picks at least half
of its experts, the same as transformers for every token). The triton backend's kernel (in Triton's
interpreter, `slow`) matches too; the exact backend's decodes run the native decode kernel with the
sinks (tests/attention/test_attention_sinks.py checks that kernel alone).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.triton_attention import TritonAttention
from blockserve.attention.triton_paged import TRITON_UNAVAILABLE
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.models.gpt_oss import GptOssForCausalLM
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.weight_checks import assert_checkpoint_loads_like_state_dict, assert_wrong_weights_are_named
from tests.paged_harness import run_paged
from tests.parity import assert_logits_close, greedy_tokens, reference_logits, reference_outputs
from tests.scenarios import PAGED_SCENARIOS, SUITE_BACKENDS, engine_prompts, paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
NUM_EXPERTS = 8
WINDOW = 8
LOGIT_TOLERANCE = 1e-4
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64)
GPT_OSS_CONFIGS = {  # name -> builder(**overrides)
    # layers 0, 2 sliding (window 8), 1 full; q/k/v/o biases; YaRN stretched 4x past 64 positions
    "gpt_oss": lambda **overrides: GptOssConfig(**{**dict(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, intermediate_size=32, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2,
        sliding_window=WINDOW, max_position_embeddings=256, rope_parameters=YARN, bos_token_id=None,
        eos_token_id=None, pad_token_id=None), **overrides}),
}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(model path, transformers reference, paged_prompts(), their reference logits, greedy tokens)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    reference = save_random_model(GPT_OSS_CONFIGS["gpt_oss"](), path)
    prompts = paged_prompts()
    return (path, reference, prompts, reference_logits(reference, prompts),
            greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS)))


@pytest.mark.parametrize("backend", SUITE_BACKENDS)
@pytest.mark.parametrize("scenario", sorted(PAGED_SCENARIOS))
def test_matches_transformers(gpt_oss, scenario, backend):
    path, _, prompts, ref_logits, ref_tokens = gpt_oss
    model = load_model(str(path), BACKENDS[backend]).model
    assert isinstance(model, GptOssForCausalLM)
    which, options = PAGED_SCENARIOS[scenario]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=LOGIT_TOLERANCE, rtol=0)
    assert tokens == [ref_tokens[i] for i in which]


def test_flex_adds_the_sinks(gpt_oss):
    """flex (its full matrix deselected by default) scales each row by sigmoid(lse - sink): the longest
    prompt, in chunks, past the window."""
    path, _, prompts, ref_logits, ref_tokens = gpt_oss
    logits, tokens = run_paged(load_model(str(path), BACKENDS["flex"]).model, prompts[2:], NEW_TOKENS, chunk=9)
    assert_logits_close(logits, ref_logits[2:], atol=LOGIT_TOLERANCE, rtol=0)
    assert tokens == ref_tokens[2:]


def test_parity_needs_the_sinks(gpt_oss):
    """The sinks are live in this config: with them at -inf (no sink) the logits leave the tolerance."""
    path, _, prompts, ref_logits, _ = gpt_oss
    model = load_model(str(path), BACKENDS["exact"]).model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    logits, _ = run_paged(model, prompts, 1)
    assert max(float((ours - theirs).abs().max()) for ours, theirs in zip(logits, ref_logits)) > 100 * LOGIT_TOLERANCE


def test_layers_alternate_sliding_and_full(gpt_oss):
    """Two KV specs, hence two groups; the native decode kernel (with sinks) serves the decodes."""
    path, *_ = gpt_oss
    model = load_model(str(path), BACKENDS["exact"]).model
    specs = model.kv_cache_specs(4)
    assert [type(specs[f"model.layers.{i}.self_attn"]) for i in range(3)] == [
        SlidingWindowSpec, FullAttentionSpec, SlidingWindowSpec]
    assert specs["model.layers.0.self_attn"].sliding_window == WINDOW
    assert all(layer.self_attn.attn.backend.sinks for layer in model.model.layers)
    assert all(len(p) > WINDOW for p in paged_prompts()[1:])


@pytest.mark.slow  # Triton's interpreter
@pytest.mark.skipif(TRITON_UNAVAILABLE is not None, reason=f"Triton unavailable: {TRITON_UNAVAILABLE}")
def test_triton_adds_the_sinks(gpt_oss):
    path, _, prompts, ref_logits, ref_tokens = gpt_oss
    logits, tokens = run_paged(load_model(str(path), TritonAttention).model, prompts, NEW_TOKENS, chunk=6,
                               stagger=True)
    assert_logits_close(logits, ref_logits, atol=LOGIT_TOLERANCE, rtol=0)
    assert tokens == ref_tokens


def test_routing_spreads_over_the_experts(gpt_oss):
    """Over the engine tests' prompts every layer picks at least half of its experts, and the experts
    blockserve picks are transformers' (so the parity above covers many experts, not one)."""
    path, reference, *_ = gpt_oss
    model = load_model(str(path), BACKENDS["exact"]).model
    layers = range(len(model.model.layers))
    ours: dict[int, list[torch.Tensor]] = {}
    hooks = [model.model.layers[i].mlp.experts.register_forward_hook(  # forward(x, weights, ids)
        lambda module, args, out, i=i: ours.setdefault(i, []).append(args[2])) for i in layers]
    theirs: dict[int, list[torch.Tensor]] = {}
    hooks += [reference.model.layers[i].mlp.router.register_forward_hook(  # (logits, weights, ids)
        lambda module, args, out, i=i: theirs.setdefault(i, []).append(out[2])) for i in layers]
    try:
        run_paged(model, engine_prompts(), 1)  # the prompts in one prefill each (and one decode step)
        with torch.no_grad():
            for p in engine_prompts():
                reference(torch.tensor([p]))
    finally:
        for hook in hooks:
            hook.remove()
    for i in layers:
        picked = ours[i][0]  # the prefill step: every prompt token, in prompt order
        assert len(picked.unique()) >= NUM_EXPERTS // 2, (i, picked.unique())
        assert torch.equal(picked.sort(-1).values, torch.cat(theirs[i]).sort(-1).values), i


def test_loads_transformers_names_and_checkpoint_names_alike(gpt_oss):
    assert_checkpoint_loads_like_state_dict(gpt_oss[0], gpt_oss[1])


def test_load_weights_names_what_is_wrong(gpt_oss):
    assert_wrong_weights_are_named(gpt_oss[1])


def test_refuses_bad_layer_types():
    with pytest.raises(ValueError, match="layer_types"):
        GptOssForCausalLM.validate(GPT_OSS_CONFIGS["gpt_oss"](layer_types=["chunked_attention"] * 3))
