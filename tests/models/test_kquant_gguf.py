"""Tiny random Llama and Qwen2 models written as GGUF in llama.cpp's Q4_K_M kind of mix (Q4_K, Q6_K
for attn_v and the head, Q5_0 for ffn_down, whose 288 columns are not whole 256-wide super-blocks)
through the real loader: their linear layers and embeddings run from the file's blocks
(GGUFBlockLinear, GGUFBlockEmbedding), with no float32 copy and no cache entry (config, tokenizer
and norms read from the file); greedy tokens equal transformers' GGUF loader's (which dequantises with
gguf-py), whole prefills, chunked ones and staggered batches; the weights' resident bytes are the
file's tensors' bytes. Llama: untied, a Q4_K token_embd and a Q6_K output; Qwen2: tied, a Q6_K
token_embd serving as the head, q/k/v biases.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models import llama_decode, loader
from blockserve.models.gguf_block_linear import GGUFBlockEmbedding, GGUFBlockLinear, block_resident_bytes
from blockserve.models.loader import load_model
from tests.models.test_gguf_block_linear import BUILDS, random_blocks
from tests.paged_harness import run_paged
from tests.parity import greedy_tokens, reference_outputs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(BUILDS["native"] is None or not BUILDS["native"].simd_lanes(),
                                 reason="the block kernels need native kernels built with AVX-512 or AVX2")]

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 512, 256, 288, 4, 2, 2
NEW_TOKENS = 8
# per format, the scale that gives weights of about 0.05 (the product of its levels' typical sizes)
TYPICAL_LEVELS = {"Q4_K": 240.0, "Q6_K": 1000.0, "Q5_0": 10.0, "Q8_0": 64.0}


def _blocks(format: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    scales = rng.uniform(0.5, 1.5, 64) * 0.05 / TYPICAL_LEVELS[format]
    return random_blocks(format, rows, columns, rng, scales)


def write_kquant_gguf(path, arch: str, seed: int = 0, formats: dict[str, str] | None = None) -> int:
    """A random `arch` ("llama" or "qwen2") model in the mix above, or with `formats` (GGUF tensor
    name -> format, e.g. Q8_0) in place of the mix's for those tensors; returns its tensors' bytes."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "llama":
        writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges([])
    head_dim = HIDDEN // HEADS
    tensors = {"token_embd.weight": ("Q4_K" if arch == "llama" else "Q6_K", VOCAB, HIDDEN),
               "output_norm.weight": ("F32", HIDDEN)}
    if arch == "llama":
        tensors["output.weight"] = ("Q6_K", VOCAB, HIDDEN)
    for i in range(LAYERS):
        tensors.update({
            f"blk.{i}.attn_norm.weight": ("F32", HIDDEN), f"blk.{i}.ffn_norm.weight": ("F32", HIDDEN),
            f"blk.{i}.attn_q.weight": ("Q4_K", HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": ("Q4_K", KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": ("Q6_K", KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": ("Q4_K", HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": ("Q4_K", FFN, HIDDEN), f"blk.{i}.ffn_up.weight": ("Q4_K", FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": ("Q5_0", HIDDEN, FFN),
        })
        if arch == "qwen2":
            tensors.update({f"blk.{i}.attn_{p}.bias": ("F32", n) for p, n in
                            (("q", HIDDEN), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim))})
    for name, format in (formats or {}).items():
        tensors[name] = (format, *tensors[name][1:])
    total = 0
    for name, (format, *shape) in tensors.items():
        if format == "F32":
            data = (1.0 + 0.1 * rng.standard_normal(shape)) if name.endswith("norm.weight") else \
                0.1 * rng.standard_normal(shape)
            data = data.astype(np.float32)
            writer.add_tensor(name, data)
        else:
            data = _blocks(format, *shape, rng)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[format])
        total += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages under the model's parameters and GGUF blocks, each storage once."""
    storages = {}
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if name.rpartition(".")[2].startswith(
        ("blocks", "packed")))]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kquant_mix_runs_from_its_blocks_as_transformers(tmp_path, arch):
    path = tmp_path / "model.gguf"
    file_bytes = write_kquant_gguf(path, arch)
    loaded = load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    model = loaded.model
    blocks = [m for m in model.modules() if isinstance(m, (GGUFBlockLinear, GGUFBlockEmbedding))]
    # per layer: qkv, o, gate_up, down; the embedding and the head (tied: model.quantized_lm_head, the same blocks)
    assert len(blocks) == 4 * LAYERS + 2
    assert isinstance(model.model.embed_tokens, GGUFBlockEmbedding)
    assert isinstance(model.lm_head if arch == "llama" else model.quantized_lm_head, GGUFBlockLinear)
    assert all(p.dim() == 1 for p in model.parameters()), "a float32 weight matrix is resident"
    formats = block_resident_bytes(model)
    assert set(formats) == {"Q4_K", "Q6_K", "Q5_0"}
    resident = resident_weight_bytes(model)
    assert abs(resident - file_bytes) <= 0.1 * file_bytes, (resident, file_bytes)
    # config and tokenizer from the metadata, every tensor from the file: no cache entry (only the
    # row crossover's measurement)
    assert not (tmp_path / "cache").exists() or {p.name for p in (tmp_path / "cache").iterdir()} <= {"row-crossover"}

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 23, 11)]
    want = greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))
    for chunk, stagger in ((None, False), (4, True)):
        _, tokens = run_paged(model, prompts, NEW_TOKENS, chunk=chunk, stagger=stagger)
        assert tokens == want, (chunk, stagger)


def test_a_decode_batch_past_8_rows_runs_in_the_native_stack(tmp_path, monkeypatch):
    """Every linear layer on the file's blocks (float32 activations): a decode step of 12 requests,
    past the in-register kernel's 8 rows, is still one native call (DecodeStack), whose tokens and
    logprobs are bitwise the flat loop's."""
    path = tmp_path / "model.gguf"
    write_kquant_gguf(path, "llama")
    loaded = load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    real_stack = llama_decode.native_stack
    stacked_rows = []

    def recorded(layers, final_norm, rows):
        stack = real_stack(layers, final_norm, rows)
        if stack is not None:
            stacked_rows.append(rows)
        return stack

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in range(3, 15)]
    results = []
    for stack in (recorded, lambda *args: None):
        monkeypatch.setattr(llama_decode, "native_stack", stack)
        llm = LLM(loaded, max_num_batched_tokens=64, block_size=4)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                        for o in outs])
        del llm
    assert max(stacked_rows) == 12
    assert results[0] == results[1]


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    write_kquant_gguf(path, "qwen2")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
