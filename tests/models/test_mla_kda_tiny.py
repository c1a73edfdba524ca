"""Tiny random DeepSeek-V3 (MLA + MoE) and Kimi Linear (MLA + KDA + MoE) models against
transformers, through paged caches of every kind they declare, without the engine.

Each model is built from a transformers config at test time (conftest.MLA_CONFIGS), given
weights far from uniform logits, saved with save_pretrained and loaded through the real loader.
Prompt logits must be close and greedy tokens equal, for both MLA flavours, through the paged
scenarios (tests/scenarios.py: prefill in one piece, in chunks, and interleaved with other
sequences' decodes).
"""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.kda import KimiDeltaAttention
from blockserve.attention.mla import ExactLengthMLA, MLAttention, WholeBlockMLA
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import LinearStateSpec, MLASpec
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_hybrid
from blockserve.models.registry import model_class
from tests.models.conftest import MLA_CONFIGS, VOCAB
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs
from tests.scenarios import PAGED_SCENARIOS, SUITE_BACKENDS, paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(MLA_CONFIGS))
def tiny(request, tiny_model):
    path, reference = tiny_model(request.param)
    prompts = paged_prompts(VOCAB)
    return (request.param, path, prompts, reference_logits(reference, prompts),
            reference_outputs(reference, prompts, NEW_TOKENS))


@pytest.mark.parametrize("scenario", sorted(PAGED_SCENARIOS))
@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_matches_transformers(tiny, backend, scenario):
    _, path, prompts, ref_logits, reference = tiny
    model = load_model(str(path), BACKENDS[backend]).model
    which, options = PAGED_SCENARIOS[scenario]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=1e-4, rtol=0)
    assert_greedy_parity(tokens, [reference[i] for i in which])


def test_registry_and_specs(tiny):
    """MLA layers: one MLASpec each, of the config's latent widths; KDA layers: the conv state
    ([q|k|v] channels x K - 1) and the recurrent state [H, D, D], zeroed at start (C1)."""
    name, path, *_ = tiny
    loaded = load_model(str(path), BACKENDS["whole_block"])
    config, model = loaded.hf_config, loaded.model
    assert type(model) is model_class(config.architectures)
    specs = model.kv_cache_specs(block_size=16)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(config.num_hidden_layers)]
    mla = MLASpec(16, config.kv_lora_rank, config.qk_rope_head_dim, "float32")
    if name == "deepseek_v3":
        assert set(specs.values()) == {mla}
    else:
        h, d, k = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
        state = LinearStateSpec(((3 * h * d, k - 1), (h, d, d)), ("float32", "float32"), chunk_size=64)  # KDA's chunk
        assert [specs[f"model.layers.{i}.self_attn"] for i in range(4)] == [state, mla, state, mla]
        assert state.state_must_start_zeroed
    declared = {m.layer_name: m for m in model.modules() if hasattr(m, "reads_unwritten_slots")}
    assert set(declared) == set(specs)
    for layer_name, module in declared.items():
        if isinstance(module, MLAttention):
            assert isinstance(module.backend, WholeBlockMLA) and module.reads_unwritten_slots
        else:
            assert isinstance(module, KimiDeltaAttention) and not module.reads_unwritten_slots
    exact = load_model(str(path), BACKENDS["exact"]).model
    assert all(isinstance(m.backend, ExactLengthMLA) and not m.reads_unwritten_slots
               for m in exact.modules() if isinstance(m, MLAttention))


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_load_weights_names_missing_unexpected_and_misshapen(tiny):
    name, path, *_ = tiny
    loaded = load_model(str(path), BACKENDS["exact"])
    weights = _checkpoint(path)
    cls = type(loaded.model)
    expert = "block_sparse_moe" if name == "kimi_linear" else "mlp"
    leaf = "w3" if name == "kimi_linear" else "up_proj"
    dropped = f"model.layers.1.{expert}.experts.3.{leaf}.weight"
    assert dropped in weights

    def build(tensors):
        cls(loaded.hf_config, BACKENDS["exact"]).load_weights(tensors.items())

    with pytest.raises(ValueError, match="missing weights .*experts.3.up_proj.weight"):
        build({k: v for k, v in weights.items() if k != dropped})
    with pytest.raises(ValueError, match=r"unexpected weights \['model\.layers\.0\.self_attn\.extra\.weight'\]"):
        build(weights | {"model.layers.0.self_attn.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\).*expects \(64,\)"):
        build(weights | {"model.norm.weight": torch.ones(65)})
    # DeepSeek's multi-token-prediction layer (past num_hidden_layers) is ignored, as transformers does.
    build(weights | {f"model.layers.{loaded.hf_config.num_hidden_layers}.eh_proj.weight": torch.zeros(1)})


def test_kimi_accepts_transformers_runtime_names(tiny_model):
    """transformers' own module names (mlp., forget_gate.) load as well as the published ones."""
    path, _ = tiny_model("kimi_linear")
    loaded = load_model(str(path), BACKENDS["exact"])
    runtime = {k.replace(".block_sparse_moe.", ".mlp.").replace(".f_a_proj", ".forget_gate.f_a_proj"): v
               for k, v in _checkpoint(path).items()}
    again = type(loaded.model)(loaded.hf_config, BACKENDS["exact"])
    again.load_weights(runtime.items())
    for (n1, p1), (n2, p2) in zip(loaded.model.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_deepseek_yarn_and_plain_rope_layout(tmp_path):
    """YaRN (its cos/sin attention factor and the softmax mscale^2) with rope_interleave off,
    and a dense-only model (first_k_dense_replace = all layers) with q_proj (no q LoRA)."""
    config = MLA_CONFIGS["deepseek_v3"]()
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.8,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 32,
                              "beta_fast": 32.0, "beta_slow": 1.0}
    config.rope_interleave = False
    config.q_lora_rank = None
    config.first_k_dense_replace = config.num_hidden_layers
    reference = save_random_hybrid(config, tmp_path)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()  # past 32
    want = reference_logits(reference, [prompt])
    model = load_model(str(tmp_path), BACKENDS["exact"]).model
    logits, _ = run_paged(model, [prompt], 1, chunk=16)
    assert_logits_close(logits, want, atol=1e-4, rtol=0)
