"""A GGUF in llama.cpp's Q4_0 / Q4_1 / Q8_0 formats (a tied Q8_0 token_embd) loads with no float32
copy of any weight: every linear layer is a QuantizedLinear over packed blocks, the embedding is
looked up from the file's blocks, no cache entry is written (the norms are read from the file), and
the greedy tokens equal transformers' GGUF loader's, prefills running on tiles dequantised from the blocks. The weights'
resident bytes are the packed layout's (measured from the allocations), and the peak RSS of a
whole load, measured in a fresh process, grows by about the file's tensor bytes, not by the float32
copies it used to make. A damaged file is refused naming the tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models import loader
from blockserve.models.gguf_block_linear import GGUFBlockEmbedding
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import PACKED_BYTES, QuantizedLinear
from blockserve.models.weight_memory import resident_weight_bytes
from tests.models.test_gguf_block_linear import BUILDS, random_blocks
from tests.paged_harness import run_paged
from tests.parity import greedy_tokens, reference_outputs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(BUILDS["native"] is None or not BUILDS["native"].simd_lanes(),
                                 reason="the block kernels need native kernels built with AVX-512 or AVX2")]

HEADS, KV_HEADS = 4, 2
# per layer tensor: its format (the attention in Q4_0, the MLP in Q4_1 but ffn_down in Q8_0, as llama.cpp's
# Q4_0 / Q4_1 files keep some tensors at 8 bits)
FORMATS = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0",
           "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


def write_gguf(path, vocab: int, hidden: int, ffn: int, layers: int, exact: bool = True) -> dict[str, int]:
    """A random Llama-shaped GGUF in FORMATS with a tied Q8_0 token_embd; `exact`: blocks quantised
    from normal weights by gguf-py, else random blocks (fast, for large files). Returns the block
    tensors' bytes per format."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges([])
    kv = KV_HEADS * hidden // HEADS
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    tensors = {"token_embd.weight": ("Q8_0", (vocab, hidden)), "output_norm.weight": ("F32", (hidden,))}
    for i in range(layers):
        tensors.update({f"blk.{i}.attn_norm.weight": ("F32", (hidden,)), f"blk.{i}.ffn_norm.weight": ("F32", (hidden,))})
        tensors.update({f"blk.{i}.{kind}.weight": (format, shapes[kind]) for kind, format in FORMATS.items()})
    sizes: dict[str, int] = {}
    for name, (format, shape) in tensors.items():
        if format == "F32":
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        kind = gguf.GGMLQuantizationType[format]
        if exact:
            data = gguf.quants.quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), kind)
        else:
            data = random_blocks(format, *shape, rng, np.array([2e-3]))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        sizes[format] = sizes.get(format, 0) + data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def packed_bytes(format: str, rows: int, columns: int) -> int:
    return -(-rows // 4) * columns // 32 * PACKED_BYTES[format]


def test_q4_q8_file_runs_from_its_blocks_as_transformers(tmp_path):
    vocab, hidden, ffn, layers = 512, 128, 256, 2
    path = tmp_path / "model.gguf"
    sizes = write_gguf(path, vocab, hidden, ffn, layers)
    # max_rows 4: every prefill of more rows runs on the tiles dequantised from the blocks
    model = load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"), quantized_max_rows=4).model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * layers + 1 and model.quantized_lm_head in linears
    assert isinstance(model.model.embed_tokens, GGUFBlockEmbedding)
    assert all(p.dim() == 1 for p in model.parameters()), "a float32 weight matrix is resident"
    kv = KV_HEADS * hidden // HEADS
    per_layer = (packed_bytes("Q4_0", hidden + 2 * kv, hidden) + packed_bytes("Q4_0", hidden, hidden)
                 + packed_bytes("Q4_1", 2 * ffn, hidden) + packed_bytes("Q8_0", hidden, ffn))
    held = resident_weight_bytes(model)
    assert held == {"Q4_0/Q4_1 packed": layers * (per_layer - packed_bytes("Q8_0", hidden, ffn)),
                    "Q8_0 packed": layers * packed_bytes("Q8_0", hidden, ffn) + packed_bytes("Q8_0", vocab, hidden),
                    "Q8_0": vocab * hidden // 32 * 34,  # the embedding: the file's blocks, rows read as looked up
                    "float32": (2 * layers + 1) * hidden * 4 + 2 * 256 * (hidden // HEADS // 2) * 4}  # norms, rotary
    # the packed layout widens the float16 scales to float32: Q4_0 24/18, Q4_1 24/20, Q8_0 36/34 of the file
    packed = held["Q4_0/Q4_1 packed"] + held["Q8_0 packed"]
    assert packed <= 24 / 18 * sum(sizes.values())
    assert not loader.gguf_cache_entry(path, tmp_path / "cache").exists()  # every tensor read from the file

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 23, 11)]
    want = greedy_tokens(reference_outputs(reference, prompts, 6))
    for chunk, stagger in ((None, False), (4, True)):
        _, tokens = run_paged(model, prompts, 6, chunk=chunk, stagger=stagger)
        assert tokens == want, (chunk, stagger)


PEAK_SCRIPT = """
import json, sys
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.weight_memory import peak_rss_bytes
from blockserve.native.extension import fused_ops, quantized_matmul_ops
quantized_matmul_ops(), fused_ops()  # built (or found) and loaded before the baseline
before = peak_rss_bytes()
load_model(sys.argv[1], BACKENDS["exact"], cache_dir=sys.argv[2], quantized_max_rows=16)
print(json.dumps({"before": before, "after": peak_rss_bytes()}))
"""


@pytest.mark.slow
def test_peak_rss_of_a_load_grows_by_about_the_files_tensor_bytes(tmp_path):
    """Two models alike but for their layer count (1 and 3), each loaded for the first time (its
    cache entry written too) in a fresh process: the peak RSS of the larger grows past the
    smaller's by at most the packed blocks of the two more layers (4/3 of their bytes in the file)
    and a little slack, well under their float32 copies (~6x the file) that a load used to make.
    (The difference cancels what every load costs alike: the modules it imports, the tokenizer.)"""
    hidden, ffn = 1024, 2816
    runs, file_bytes = {}, {}
    for layers in (1, 3):
        path = tmp_path / f"model-{layers}.gguf"
        file_bytes[layers] = sum(write_gguf(path, 256, hidden, ffn, layers, exact=False).values())
        runs[layers] = subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, str(path), str(tmp_path / "cache")],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    grown = {}
    for layers, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        peak = json.loads(out.strip().splitlines()[-1])
        grown[layers] = peak["after"] - peak["before"]
    more_file = file_bytes[3] - file_bytes[1]
    more_float32 = 2 * 4 * (2 * hidden * hidden + 2 * (KV_HEADS * hidden // HEADS) * hidden + 3 * ffn * hidden)
    slack = 12 << 20
    assert grown[3] - grown[1] <= 4 / 3 * more_file + slack, (grown, more_file)
    assert 4 / 3 * more_file + slack < more_float32 / 2  # the bound would catch a float32 copy


def _write_tensors(path, tensors) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name, data, kind in tensors:
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=(64, data.shape[1]) if name == "blk.0.attn_q.weight" else data.shape,
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("damage", ["truncated", "short blocks", "short last blocks"])
def test_a_damaged_file_is_refused_naming_the_tensor(tmp_path, damage):
    """Written by gguf-py: a file cut inside its last tensor, and a tensor whose blocks are fewer
    than its shape needs (its info says 64 rows, 32 were written), followed by another tensor
    or last in the file. The error names the tensor, at load, and leaves no cache entry."""
    q4 = gguf.quants.quantize(np.ones((32 if damage != "truncated" else 64, 64), np.float32),
                              gguf.GGMLQuantizationType.Q4_0)
    norm = ("output_norm.weight", np.ones(64, np.float32), None)
    attn_q = ("blk.0.attn_q.weight", q4, gguf.GGMLQuantizationType.Q4_0)
    path = tmp_path / "model.gguf"
    _write_tensors(path, [norm, attn_q] if damage != "short blocks" else [attn_q, norm])
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    expected = {"truncated": "blk.0.attn_q.weight: .* run past the end of the file .* truncated",
                "short blocks": "blk.0.attn_q.weight: its shape needs 2304 bytes but the next tensor "
                                r"\(output_norm.weight\) starts 1152 bytes after it",
                "short last blocks": "blk.0.attn_q.weight: .* run past the end of the file"}[damage]
    with pytest.raises(ValueError, match=expected):
        load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # refused before the cache is touched


def test_each_tensors_blocks_are_checked_once_and_a_bad_scale_refused(tmp_path, monkeypatch):
    """The block modules and then quantized_linear see the Q4_0 / Q4_1 / Q8_0 tensors: a load checks
    each tensor's blocks (every scale read, check_blocks) once, and a non-finite scale in a tensor
    quantized_linear packs is refused at load, naming it."""
    path = tmp_path / "model.gguf"
    write_gguf(path, 64, 64, 64, 1, exact=False)
    checked = []
    real = loader.check_blocks
    monkeypatch.setattr(loader, "check_blocks", lambda name, *args: (checked.append(name), real(name, *args))[1])
    load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"), quantized_max_rows=4)
    reader = gguf.GGUFReader(path)
    assert sorted(checked) == sorted(t.name for t in reader.tensors if t.tensor_type.name != "F32")

    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")  # Q8_0: a float16 scale first
    data = bytearray(path.read_bytes())
    data[down.data_offset:down.data_offset + 2] = np.float16(np.inf).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight: Q8_0 blocks with non-finite scales"):
        load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"), quantized_max_rows=4)
