"""Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE against transformers.

Built from configs at test time (8 experts, top-2; Qwen's dense layers where its config says),
initialised far from uniform logits, saved with save_pretrained and loaded through the real loader;
run through paged attention blocks with NaN in every unused block (tests/paged_harness.py), by both
expert routes (moe.Experts: the loop over the experts picked, and the grouped matmuls).
Prompt logits within 1e-4 of transformers' (the largest difference measured is 1.1e-5), greedy
tokens equal. Routing: over the engine tests' prompts every MoE layer picks all 8 experts (asserted:
at least half), the same experts as transformers for every token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.moe import Experts, SparseMoe
from blockserve.models.random_checkpoint import save_random_model
from blockserve.models.registry import model_class
from tests.models.weight_checks import assert_checkpoint_loads_like_state_dict, assert_wrong_weights_are_named
from tests.paged_harness import run_paged
from tests.parity import assert_logits_close, greedy_tokens, reference_logits, reference_outputs
from tests.scenarios import PAGED_SCENARIOS, engine_prompts, paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
NUM_EXPERTS = 8
_COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE_CONFIGS = {  # name -> builder(**overrides of _COMMON or of the window settings)
    # per-head q/k norms; layer 1 dense (mlp_only_layers); renormalised top-k
    "qwen3_moe": lambda **overrides: Qwen3MoeConfig(
        **{**_COMMON, **overrides}, head_dim=16, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
        num_experts=NUM_EXPERTS, norm_topk_prob=True, mlp_only_layers=[1]),
    # q/k/v biases; every second layer MoE (decoder_sparse_step), the others dense; the sigmoid-gated
    # shared expert; top-k weights as the softmax gives them (norm_topk_prob False)
    "qwen2_moe": lambda **overrides: Qwen2MoeConfig(
        **{**_COMMON, **overrides}, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=NUM_EXPERTS, norm_topk_prob=False, decoder_sparse_step=2),
    # every layer MoE, always renormalised
    "mixtral": lambda **overrides: MixtralConfig(
        **{**_COMMON, **overrides}, num_hidden_layers=3, intermediate_size=32, num_local_experts=NUM_EXPERTS),
}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_LAYERS = {"qwen3_moe": [0, 2], "qwen2_moe": [1, 3], "mixtral": [0, 1, 2]}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """name -> (path of the saved model, its transformers reference), built on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = path, save_random_model(MOE_CONFIGS[name](), path)
        return built[name]

    return get


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def family(request, moe_models):
    """(name, path, reference, paged_prompts(), their reference logits, greedy tokens)."""
    path, reference = moe_models(request.param)
    prompts = paged_prompts()
    return (request.param, path, reference, prompts, reference_logits(reference, prompts),
            greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS)))


def _set_route(model, route: str) -> None:
    for module in model.modules():
        if isinstance(module, Experts):
            module.route = route


@pytest.mark.parametrize("route", Experts.ROUTES)
@pytest.mark.parametrize("scenario", sorted(PAGED_SCENARIOS))
def test_matches_transformers(family, scenario, route):
    _, path, _, prompts, ref_logits, ref_tokens = family
    model = load_model(str(path), BACKENDS["exact"]).model
    _set_route(model, route)
    which, options = PAGED_SCENARIOS[scenario]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=1e-4, rtol=0)
    assert tokens == [ref_tokens[i] for i in which]


def test_logits_are_far_from_uniform(family):
    """Greedy parity means little if the top two tokens are near-ties."""
    ref_logits = family[4]
    top2 = torch.cat(ref_logits).log_softmax(-1).topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.1


def test_layers_are_moe_where_the_config_says(family):
    name, path, *_ = family
    model = load_model(str(path), BACKENDS["exact"]).model
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoe)] == MOE_LAYERS[name]
    shared = [layers[i].mlp.shared_expert is not None for i in MOE_LAYERS[name]]
    assert shared == [name == "qwen2_moe"] * len(shared)
    assert all(layers[i].mlp.experts.gate_up_proj.shape[0] == NUM_EXPERTS for i in MOE_LAYERS[name])


def test_routing_spreads_over_the_experts(family):
    """Over the engine tests' prompts every MoE layer picks at least half of its experts, and the
    experts blockserve picks are transformers' (so the parity above covers many experts, not one)."""
    _, path, reference, *_ = family
    model = load_model(str(path), BACKENDS["exact"]).model
    prompts = engine_prompts()
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoe)]
    ours: dict[int, list[torch.Tensor]] = {}
    hooks = [model.model.layers[i].mlp.experts.register_forward_hook(  # forward(x, weights, ids)
        lambda module, args, out, i=i: ours.setdefault(i, []).append(args[2])) for i in moe_layers]
    theirs: dict[int, list[torch.Tensor]] = {}
    hooks += [reference.model.layers[i].mlp.gate.register_forward_hook(  # transformers' router: (logits, weights, ids)
        lambda module, args, out, i=i: theirs.setdefault(i, []).append(out[2])) for i in moe_layers]
    try:
        run_paged(model, prompts, 1)  # the prompts in one prefill each (and one decode step)
        with torch.no_grad():
            for p in prompts:
                reference(torch.tensor([p]))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(ours) == sorted(theirs) == moe_layers
    for i in ours:
        picked = torch.cat(ours[i][:1])  # the prefill step: every prompt token, in prompt order
        assert len(picked.unique()) >= NUM_EXPERTS // 2, (i, picked.unique())
        expected = torch.cat(theirs[i])
        assert torch.equal(picked.sort(-1).values, expected.sort(-1).values), i


def test_loads_transformers_names_and_checkpoint_names_alike(family):
    """The saved checkpoint holds one tensor per expert (Mixtral: block_sparse_moe.experts.N.w1/w2/w3);
    transformers' state_dict the stacked ones."""
    _, path, reference, *_ = family
    assert_checkpoint_loads_like_state_dict(path, reference)


def test_load_weights_names_what_is_wrong(family):
    assert_wrong_weights_are_named(family[2])


SLIDING = {  # an 8-token window: on every layer (Mixtral, Qwen3-MoE), on layer 0 only (Qwen2-MoE's layer_types)
    "mixtral": dict(sliding_window=8),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=8),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_matches_transformers(tmp_path, name):
    """The Llama family's sliding-window attention, on the layers transformers applies it to; the
    prompts and their 8 new tokens run past the window, in chunks (blocks fall out of it)."""
    reference = save_random_model(MOE_CONFIGS[name](**SLIDING[name]), tmp_path)
    model = load_model(str(tmp_path), BACKENDS["exact"]).model
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == ([8, None, None, None] if name == "qwen2_moe" else [8] * len(windows))
    prompts = paged_prompts()
    logits, tokens = run_paged(model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    assert_logits_close(logits, reference_logits(reference, prompts), atol=1e-4, rtol=0)
    assert tokens == greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))


def test_registered():
    for name in ARCHITECTURES.values():
        assert model_class([name]).__name__ == name
