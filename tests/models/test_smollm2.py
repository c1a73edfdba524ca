"""The default model, SmolLM2-135M-Instruct from its GGUF, against transformers loading the same file.

The transformers reference is loaded once per module; blockserve reads the config, the tokenizer
and every tensor from the file itself (no conversion, nothing cached but the row crossover's
measurement), on a first load and on a second from a copy of the file elsewhere.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from transformers.integrations.gguf import read_gguf_metadata

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models import loader, row_crossover
from blockserve.models.default_model import default_model_path
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import QuantizedLinear
from blockserve.native.extension import quantized_matmul_ops
from tests.paged_harness import run_paged
from tests.parity import assert_greedy_parity, assert_logits_close, greedy_tokens, reference_logits, reference_outputs

pytestmark = pytest.mark.slow  # the real model: converting its GGUF and transformers' load, ~90 s

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a poet."},
     {"role": "user", "content": "Write four lines about the sea at night, with a rhyme in every second line."}],
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def reference(loaded, smollm2_transformers):
    """transformers' logits and reference outputs for the chat prompts (tokenised by blockserve's tokenizer)."""
    model = smollm2_transformers
    tokenizer = loaded[1]["exact"].tokenizer
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
               for chat in CHATS]
    return prompts, reference_logits(model, prompts), reference_outputs(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One load per backend, neither converting the file: the second, from a copy of the file
    elsewhere, keeps float32 weights only, so both matmul paths are compared with transformers."""
    cache_dir = tmp_path_factory.mktemp("blockserve-cache")
    copy = tmp_path_factory.mktemp("another-environment") / default_model_path().name
    shutil.copyfile(default_model_path(), copy)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "_convert_gguf", lambda *args: pytest.fail("the GGUF was converted"))
        patch.setattr(row_crossover, "MEASURED", {})  # measured here (not taken from an earlier test's load)
        start = time.perf_counter()
        first = load_model(None, BACKENDS["exact"], cache_dir=str(cache_dir))
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        second = load_model(str(copy), BACKENDS["whole_block"], cache_dir=str(cache_dir), quantized_matmul=False)
        second_s = time.perf_counter() - start
    print(f"\nSmolLM2 GGUF load: first {first_s:.1f} s, second (float32 weights) {second_s:.1f} s")
    return cache_dir, {"exact": first, "whole_block": second}


def test_nothing_is_cached_but_the_row_crossover(loaded):
    cache_dir, models = loaded
    assert sorted(p.name for p in cache_dir.iterdir()) == ["row-crossover"]
    assert models["exact"].hf_config.architectures == ["LlamaForCausalLM"]


def test_tokenizer_keeps_gguf_chat_template_and_special_tokens(loaded):
    metadata, _ = read_gguf_metadata(str(default_model_path()), ("tokenizer.ggml.tokens",))
    tokenizer = loaded[1]["exact"].tokenizer
    assert tokenizer.chat_template == metadata["tokenizer.chat_template"]
    vocab = metadata["tokenizer.ggml.tokens"]
    assert tokenizer.eos_token == vocab[metadata["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tokenizer.convert_ids_to_tokens(tokenizer("Hello, world!")["input_ids"]) == ["Hello", ",", "Ġworld", "!"]


@pytest.mark.parametrize("backend", ["exact", "whole_block"])  # the two `loaded` builds (flex: 30 layers eager is slow)
def test_matches_transformers(reference, loaded, backend):
    prompts, ref_logits, ref_outputs = reference
    logits, tokens = run_paged(loaded[1][backend].model, prompts, NEW_TOKENS, block_size=16, stagger=True)
    assert_logits_close(logits, ref_logits, atol=1e-3, rtol=0)
    assert_greedy_parity(tokens, ref_outputs)


def test_every_linear_keeps_its_gguf_blocks_in_the_right_order(loaded):
    """The blocks each layer reads, at small batches and past them (the dequantised tiles), give the
    same matmul as the file's weights dequantised by gguf-py (the loader's float32 path): q/k rows
    unpermuted, q/k/v and gate/up concatenated in the same order, the tied lm_head from the Q8_0
    embedding."""
    ops = quantized_matmul_ops()
    if ops is None or not ops.simd_lanes():
        pytest.skip("the quantized kernel needs native kernels built with AVX-512 or AVX2")
    model = loaded[1]["exact"].model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; lm_head
    assert model.quantized_lm_head in layers
    assert not any(isinstance(m, QuantizedLinear) for m in loaded[1]["whole_block"].model.modules())
    file_weights = dict(loader._gguf_tensors(loader._gguf_reader(default_model_path()), "llama", model.config,
                                             lambda name, tensor: name.endswith(("proj.weight", "embed_tokens.weight"))))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        parent, _, leaf = name.rpartition(".")
        weight = (file_weights["model.embed_tokens.weight"] if name == "quantized_lm_head" else
                  torch.cat([file_weights[f"{parent}.{part}.weight"] for part in fused.get(leaf, (leaf,))]))
        assert torch.equal(layer.weight, weight), name
        for rows in (3, layer.max_rows + 1) if name.startswith(("model.layers.0.", "quantized_lm_head")) else (3,):
            x = torch.randn(rows, layer.in_features)
            want = torch.nn.functional.linear(x, weight)
            torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5 * want.abs().max().item())


# activations: (mean bound, max bound, near-tie) on logits against transformers'; measured below.
INTEGER_BOUNDS = {"int8": (0.5, 4, 0.5), "int16": (0.01, 0.1, 0.05)}


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_integer_activations_stay_within_their_stated_bound(reference, loaded, smollm2_transformers, activations):
    """--quantized-activations int8 (llama.cpp's rounding of x per block of 32) and int16 reach every
    GGUF layer and keep the model: int8's logits within 0.5 of transformers' on average (measured
    ~0.2) and never 4 apart (measured up to 2.8), int16's within 0.01 (measured ~1e-3) and 0.1
    (measured ~0.01); greedy tokens identical up to the first step where transformers' top two
    logits are within the near-tie margin (0.5, 0.05), which the rounding may flip."""
    mean_bound, max_bound, near_tie = INTEGER_BOUNDS[activations]
    ops = quantized_matmul_ops()
    if ops is None or not ops.simd_lanes():
        pytest.skip("the quantized kernel needs native kernels built with AVX-512 or AVX2")
    model = load_model(None, BACKENDS["exact"], cache_dir=str(loaded[0]), quantized_activations=activations).model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(layer.activations == activations for layer in layers)
    prompts, ref_logits, ref_outputs = reference
    ref_tokens = greedy_tokens(ref_outputs)
    logits, tokens = run_paged(model, prompts, NEW_TOKENS, block_size=16, stagger=True)
    for got, want in zip(logits, ref_logits):
        error = (got - want).abs()
        print(f"{activations}: logits off transformers' by {error.mean():.3g} on average, at most {error.max():.3g}")
        assert error.mean() < mean_bound and error.max() < max_bound, (error.mean(), error.max())
    for prompt, got, want in zip(prompts, tokens, ref_tokens):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is not None:  # transformers' logits at that step, over the tokens it had generated
            with torch.no_grad():
                step = smollm2_transformers(torch.tensor([prompt + want[:first]])).logits[0, -1]
            top2 = step.topk(2).values
            assert top2[0] - top2[1] < near_tie, f"{activations} left transformers' greedy path at step {first}, not a near-tie"
