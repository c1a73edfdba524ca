"""Hugging Face checkpoints in bfloat16 / float16 through the real loader with 16-bit weights kept
(Placement.keep_16bit_weights, the engine's dtype auto on the CPU): transformers' float32 model
loaded from the same 16-bit values is the reference; the weights hold about the checkpoint's bytes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.half_linear import HalfEmbedding, HalfLinear
from blockserve.models.loader import load_model
from blockserve.models.placement import Placement
from blockserve.models.random_checkpoint import save_random_model
from blockserve.models.weight_memory import resident_weight_bytes, weight_memory_report
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, reference_logits, reference_outputs
from tests.scenarios import PAGED_SCENARIOS, paged_prompts

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
CONFIGS = {
    "llama-bf16": (lambda: LlamaConfig(**SIZES), torch.bfloat16),
    "qwen2-tied-f16": (lambda: Qwen2Config(**SIZES, tie_word_embeddings=True), torch.float16),
}
NEW_TOKENS = 16
KEEP = Placement(keep_16bit_weights=True)


def save_16bit(config, dtype: torch.dtype, path) -> None:
    """A random checkpoint saved in `dtype` (as a 16-bit Hugging Face release is)."""
    save_random_model(config, path).to(dtype).save_pretrained(path)


def float32_reference(path):
    """transformers' model loaded in float32 from the 16-bit checkpoint at `path`."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def checkpoint_bytes(path) -> int:
    with safe_open(path / "model.safetensors", framework="pt") as weights:
        return sum(weights.get_tensor(k).nbytes for k in weights.keys())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    config, dtype = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_16bit(config(), dtype, path)
    reference = float32_reference(path)
    prompts = paged_prompts(SIZES["vocab_size"])
    return path, dtype, prompts, reference_logits(reference, prompts), reference_outputs(reference, prompts, NEW_TOKENS)


def test_16bit_weights_match_transformers_float32(saved):
    path, dtype, prompts, ref_logits, reference = saved
    model = load_model(str(path), BACKENDS["exact"], placement=KEEP).model
    linears = [m for m in model.modules() if isinstance(m, HalfLinear)]
    assert len(linears) == 4 * SIZES["num_hidden_layers"] + 1  # qkv, o, gate_up, down per layer; the head
    assert all(linear.weight.dtype == dtype for linear in linears)
    assert isinstance(model.model.embed_tokens, HalfEmbedding)
    if model.tie_word_embeddings:
        assert model.tied_lm_head.weight is model.model.embed_tokens.weight
    which, options = PAGED_SCENARIOS["batch-of-3"]
    logits, tokens = run_paged(model, [prompts[i] for i in which], NEW_TOKENS, **options)
    assert_logits_close(logits, [ref_logits[i] for i in which], atol=1e-4, rtol=0)
    assert_greedy_parity(tokens, [reference[i] for i in which])


def test_resident_weights_are_the_checkpoint_bytes_and_float32_doubles_them(saved):
    """Counted from the storages the model holds (each once): within 10% of the checkpoint's
    tensor bytes when kept, about twice them when widened (Placement's default, dtype float32)."""
    path, dtype, *_ = saved
    on_disk = checkpoint_bytes(path)
    kept = resident_weight_bytes(load_model(str(path), BACKENDS["exact"], placement=KEEP).model)
    assert abs(sum(kept.values()) - on_disk) <= 0.1 * on_disk, (kept, on_disk)
    assert kept[str(dtype).removeprefix("torch.")] > 0.9 * on_disk
    widened = resident_weight_bytes(load_model(str(path), BACKENDS["exact"]).model)
    assert set(widened) == {"float32"} and widened["float32"] > 1.8 * on_disk
    report = weight_memory_report(load_model(str(path), BACKENDS["exact"], placement=KEEP).model)
    assert str(dtype).removeprefix("torch.") in report and "peak RSS by the end of loading" in report


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_gguf_tensors_stay_16bit(tmp_path, monkeypatch, dtype):
    """A GGUF whose matrices are F16 / BF16 (as llama.cpp's converter writes with --outtype f16 / bf16)
    loads with those matrices in their 16 bits: the same parameters and logits as the 16-bit
    safetensors directory of the same weights."""
    from tests.models import test_dense_gguf

    class SixteenBitWriter(gguf.GGUFWriter):  # the matrices in `dtype`, the norms float32
        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None):
            if tensor.ndim == 2 and dtype == torch.float16:
                tensor = tensor.astype(np.float16)
            elif tensor.ndim == 2:
                tensor = (tensor.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
                raw_dtype = gguf.GGMLQuantizationType.BF16
            super().add_tensor(name, tensor, raw_shape=raw_shape, raw_dtype=raw_dtype)

    reference = save_random_model(test_dense_gguf.DENSE_GGUF_CONFIGS["smollm3"](), tmp_path / "hf")
    reference.to(dtype).save_pretrained(tmp_path / "hf")
    reference.to(dtype).float()  # the 16-bit values, as the GGUF holds them
    monkeypatch.setattr(gguf, "GGUFWriter", SixteenBitWriter)
    test_dense_gguf.write_gguf(reference, tmp_path / "model.gguf", "smollm3")
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"),
                           placement=KEEP).model
    from_dir = load_model(str(tmp_path / "hf"), BACKENDS["exact"], placement=KEEP).model
    ours, theirs = dict(from_gguf.named_parameters()), dict(from_dir.named_parameters())
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert sum(isinstance(m, HalfLinear) for m in from_gguf.modules()) == 4 * 4 + 1
    prompts = paged_prompts()
    gguf_logits, gguf_tokens = run_paged(from_gguf, prompts, 4)
    dir_logits, dir_tokens = run_paged(from_dir, prompts, 4)
    assert gguf_tokens == dir_tokens
    for got, want in zip(gguf_logits, dir_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_moe_and_mla_families_keep_what_they_can(tmp_path, family):
    """Stacked experts and MLA's kv_b_proj (read as a matrix) are widened, the rest kept 16-bit; the
    outputs are still transformers' float32 model's over the same bfloat16 values."""
    from tests.models.conftest import MLA_CONFIGS
    from tests.models.test_moe_families import MOE_CONFIGS

    save_16bit({**MOE_CONFIGS, **MLA_CONFIGS}[family](), torch.bfloat16, tmp_path)
    reference = float32_reference(tmp_path)
    model = load_model(str(tmp_path), BACKENDS["exact"], placement=KEEP).model
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    widened = [dtype for name, dtype in dtypes.items() if ".experts." in name or "kv_b_proj" in name]
    assert widened and all(dtype == torch.float32 for dtype in widened)
    assert dtypes["model.layers.0.self_attn.o_proj.weight"] == torch.bfloat16
    prompts = paged_prompts(SIZES["vocab_size"])[:2]
    logits, tokens = run_paged(model, prompts, 6)
    assert_logits_close(logits, reference_logits(reference, prompts), atol=1e-4, rtol=0)
    assert_greedy_parity(tokens, reference_outputs(reference, prompts, 6))
