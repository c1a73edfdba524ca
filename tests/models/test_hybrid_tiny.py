"""Tiny random hybrid models (Qwen3-Next: Gated DeltaNet; Granite 4.0-H: Mamba2) against transformers.

Built from configs at test time, initialised far from uniform logits, saved with save_pretrained
and loaded through the real loader; run through paged attention blocks and state slots with
NaN in every unused block and slot.
"""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import FullAttentionSpec, LinearStateSpec
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.models.registry import model_class
from tests.models.conftest import STATE_CONFIGS, state_model_prompts
from tests.models.weight_checks import assert_checkpoint_loads_like_state_dict, assert_wrong_weights_are_named
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
WHICH = [0, 2, 4, 14]  # 1, 28, 4 and 37 tokens
# The paged scenarios of tests/scenarios.py, cut for the recurrent state: four prompts, and chunks
# shorter than the conv kernel.
STATE_SCENARIOS = {
    "single": ([3], {}),
    "batch-staggered-chunks": ([0, 1, 2, 3], {"stagger": True, "chunk": 5}),  # decodes and prefill chunks share steps
    "chunks-shorter-than-conv": ([1, 3], {"chunk": 3}),  # the conv state spans several chunks
}


@pytest.fixture(scope="module", params=sorted(STATE_CONFIGS))
def tiny(request, tiny_model):
    path, reference = tiny_model(request.param)
    prompt_sets = [state_model_prompts()[i] for i in WHICH]
    return (path, reference, prompt_sets, reference_logits(reference, prompt_sets),
            reference_outputs(reference, prompt_sets, NEW_TOKENS))


@pytest.mark.parametrize("scenario", sorted(STATE_SCENARIOS))
def test_matches_transformers(tiny, scenario):
    path, _, prompt_sets, ref_logits, ref_outputs = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    which, options = STATE_SCENARIOS[scenario]
    logits, tokens = run_paged(model, [prompt_sets[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=3e-4, rtol=1e-4)  # chunks sum in another order
    assert_greedy_parity(tokens, [ref_outputs[i] for i in which])  # no near-tie occurs here: equality


def test_logits_are_far_from_uniform(tiny):
    """Greedy parity means little if the top two tokens are near-ties."""
    _, _, _, ref_logits, _ = tiny
    top2 = torch.cat(ref_logits).log_softmax(-1).topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.1


def test_kv_specs_and_declarations(tiny):
    """Attention layers hold blocks, recurrent layers one state slot; every KV layer has a module that
    declares reads_unwritten_slots (C1), False for the recurrent ones (their zeroing comes from the spec)."""
    path = tiny[0]
    model = load_model(str(path), BACKENDS["whole_block"]).model
    specs = model.kv_cache_specs(4)
    kinds = {name: type(spec) for name, spec in specs.items()}
    config = model.config
    for i, layer_type in enumerate(config.layer_types):
        assert sum(name.startswith(f"model.layers.{i}.") for name in specs) == 1
        assert [kind for name, kind in kinds.items() if name.startswith(f"model.layers.{i}.")] == [
            FullAttentionSpec if layer_type == "full_attention" else LinearStateSpec]
    states = {spec for spec in specs.values() if isinstance(spec, LinearStateSpec)}
    assert len(states) == 1 and next(iter(states)).starts_zeroed
    assert all(dtype == "float32" for spec in states for dtype in spec.dtypes)
    declared = {m.layer_name: m.reads_unwritten_slots for m in model.modules()
                if hasattr(m, "layer_name") and hasattr(m, "reads_unwritten_slots")}
    assert set(declared) == set(specs)
    for name, spec in specs.items():
        assert declared[name] == (not isinstance(spec, LinearStateSpec))  # whole_block reads unwritten slots


def test_loads_transformers_names_and_checkpoint_names_alike(tiny):
    """The saved checkpoint uses the original expert names (Qwen: one tensor per expert; Granite:
    input_linear / output_linear / router.layer); transformers' state_dict the stacked ones."""
    path, reference, *_ = tiny
    assert_checkpoint_loads_like_state_dict(path, reference)


def test_load_weights_names_what_is_wrong(tiny):
    assert_wrong_weights_are_named(tiny[1])


def test_granite_without_rope_dense_and_tied(tmp_path):
    """Granite 4.0-H as released: no position embedding ("nope"), tied embeddings; the micro model
    is dense (shared MLP only)."""
    config = STATE_CONFIGS["granitemoehybrid"]()
    config.position_embedding_type, config.num_local_experts, config.tie_word_embeddings = None, 0, True
    reference = save_random_model(config, tmp_path)
    prompt = state_model_prompts()[14]
    model = load_model(str(tmp_path), BACKENDS["exact"]).model
    assert model.model.rotary is None and model.model.layers[0].block_sparse_moe is None
    logits, tokens = run_paged(model, [prompt], NEW_TOKENS, chunk=6)
    assert_logits_close(logits, reference_logits(reference, [prompt]), atol=1e-4, rtol=1e-4)
    assert_greedy_parity(tokens, reference_outputs(reference, [prompt], NEW_TOKENS))


def test_registered():
    for name in ("Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM"):
        assert model_class([name]).__name__ == name
