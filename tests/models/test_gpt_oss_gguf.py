"""GPT-OSS from GGUF files written here with gguf-py as llama.cpp's converter writes its `gpt-oss`
architecture: tensor names from gguf-py's own table (the sinks as `attn_sinks.weight`, the router as
`ffn_gate_inp`, the post-attention norm as `post_attention_norm`), the interleaved gate|up split into
`ffn_gate_exps` / `ffn_up_exps` with their biases, experts [E, out, in]; its metadata (YaRN under
rope.scaling.*, the sliding window, key_length, expert_feed_forward_length; no layer pattern: llama.cpp's
fixed alternation).

The MXFP4 file holds test_gpt_oss_mxfp4.py's checkpoint's experts as ggml's MXFP4 blocks, repacked here
by this file's own encoder (gguf-py's dequantiser checks the repack), the rest float32. Loaded through
the real loader it matches the safetensors load of that checkpoint: every parameter equal (the expert
blocks byte for byte), logits equal up to float32 rounding, greedy tokens equal; the experts stay
MXFP4 in memory, their bytes the file's. A file with float32 experts loads as the float checkpoint.
One with experts in other block formats (Q8_0, K-quants: llama-quantize's mixes) runs them from the
file's blocks (GptOssGGUFBlockExperts, csrc/moe_experts.cpp), no float32 copy made, as the float
checkpoint of their dequantised values runs and transformers' greedy tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.gguf_block_experts import GptOssGGUFBlockExperts
from blockserve.models.gpt_oss import GptOssForCausalLM, gpt_oss_expert_ops, is_mxfp4
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.mxfp4_encoder import decode_mxfp4
from tests.models.test_gpt_oss import GPT_OSS_CONFIGS, NEW_TOKENS
from tests.models.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint
from tests.models.test_moe_gguf_blocks import _blocks
from tests.parity import greedy_tokens, reference_outputs
from tests.paged_harness import run_paged
from tests.scenarios import paged_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG_KEYS = ("sliding_window", "layer_types", "head_dim", "intermediate_size", "num_local_experts",
               "num_experts_per_tok", "rope_parameters", "tie_word_embeddings")


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's MXFP4 (blocks [..., N, K/32, 16]: byte j holds values 2j low, 2j+1 high) as
    ggml rows [..., N, K/32 * 17]: per block its e8m0 scale, then values 0-15 low and 16-31 high."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate((scales[..., None], packed), axis=-1).reshape(*scales.shape[:-1], -1).astype(np.uint8)


def _gguf_tensors(tensors: dict[str, torch.Tensor], num_layers: int):
    """(GGUF name, array, raw ggml type or None) of a GPT-OSS checkpoint's tensors, as the converter
    writes them."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, num_layers)

    def gguf_name(key: str) -> str:
        name = table.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        return name

    for key, tensor in tensors.items():
        if key.endswith("_scales"):
            continue
        prefix, _, leaf = key.rpartition(".")
        if leaf in ("gate_up_proj_blocks", "down_proj_blocks"):
            raw = ggml_mxfp4(tensor.numpy(), tensors[key.replace("_blocks", "_scales")].numpy())
            for part, rows in (("gate_proj", raw[:, 0::2]), ("up_proj", raw[:, 1::2])) if leaf.startswith("gate") \
                    else (("down_proj", raw),):
                yield gguf_name(f"{prefix}.{part}.weight"), np.ascontiguousarray(rows), gguf.GGMLQuantizationType.MXFP4
            continue
        array = tensor.float().numpy()
        if leaf in ("gate_up_proj", "down_proj"):  # transformers' [E, in, out] -> [E, out, in]
            array = array.swapaxes(1, 2)
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):
            suffix = ".bias" if leaf.endswith("bias") else ".weight"
            yield gguf_name(f"{prefix}.gate_proj{suffix}"), np.ascontiguousarray(array[:, 0::2]), None
            yield gguf_name(f"{prefix}.up_proj{suffix}"), np.ascontiguousarray(array[:, 1::2]), None
            continue
        if leaf in ("down_proj", "down_proj_bias"):
            yield gguf_name(f"{prefix}.down_proj{'.bias' if leaf.endswith('bias') else '.weight'}"), array, None
            continue
        yield gguf_name(key + ".weight" if leaf == "sinks" else key), array, None


def write_gguf(checkpoint, config, path, widen=(), blocks=None) -> int:
    """The GGUF of the checkpoint directory `checkpoint` (built from `config`) at `path`, the MXFP4
    tensors named in `widen` written as float32 instead, those named in `blocks` ({GGUF name: (format,
    raw blocks)}) as those blocks; returns the bytes of its MXFP4 tensors."""
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    mxfp4_bytes = 0
    for name, array, raw_dtype in _gguf_tensors(load_file(str(checkpoint / "model.safetensors")),
                                                config.num_hidden_layers):
        if raw_dtype is not None and name in widen:
            array, raw_dtype = gguf.quants.dequantize(array, raw_dtype), None
        if blocks and name in blocks:
            format, array = blocks[name]
            writer.add_tensor(name, array, raw_shape=array.shape, raw_dtype=gguf.GGMLQuantizationType[format])
            continue
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
        mxfp4_bytes += array.nbytes if raw_dtype is not None else 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return mxfp4_bytes


def _assert_loads_alike(from_gguf, from_dir) -> None:
    assert type(from_gguf.model) is type(from_dir.model) is GptOssForCausalLM
    for key in CONFIG_KEYS:
        assert getattr(from_gguf.hf_config, key, None) == getattr(from_dir.hf_config, key, None), key
    assert is_mxfp4(from_gguf.hf_config) == is_mxfp4(from_dir.hf_config)
    ours, theirs = dict(from_gguf.model.named_parameters()), dict(from_dir.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_the_ggml_repack_holds_the_checkpoints_values():
    """This file's encoder against gguf-py's own MXFP4 dequantiser."""
    gen = np.random.default_rng(0)
    blocks = gen.integers(0, 256, (3, 2, 16), dtype=np.uint8)
    scales = gen.integers(110, 140, (3, 2), dtype=np.uint8)
    values = gguf.quants.dequantize(ggml_mxfp4(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(values, decode_mxfp4(blocks, scales).astype(np.float32))


def test_mxfp4_gguf_loads_as_the_safetensors_model(tmp_path):
    config = GPT_OSS_CONFIGS["gpt_oss"]()
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    written = write_mxfp4_checkpoint(checkpoint)
    mxfp4_bytes = write_gguf(checkpoint, config, tmp_path / "model.gguf")
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(checkpoint), BACKENDS["exact"])
    _assert_loads_alike(from_gguf, from_dir)
    experts = {name: p for name, p in from_gguf.model.named_parameters()
               if ".mlp.experts." in name and not name.endswith("bias")}
    assert {p.dtype for p in experts.values()} == {torch.uint8}
    assert sum(p.nbytes for p in experts.values()) == mxfp4_bytes == sum(written.values())
    cached = load_file(str(next((tmp_path / "cache").glob("gguf-*")) / "model.safetensors"))
    assert not any(".mlp.experts." in name and not name.endswith("bias") for name in cached)  # no float copy
    _assert_runs_alike(from_gguf, from_dir, atol=1e-5)


def _assert_runs_alike(from_gguf, from_dir, atol: float) -> list:
    """Both loads run the same paged prompts (chunked, staggered) to logits within `atol` and the same
    greedy tokens; returns those tokens."""
    prompts = paged_prompts()
    gguf_logits, gguf_tokens = run_paged(from_gguf.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    dir_logits, dir_tokens = run_paged(from_dir.model, prompts, NEW_TOKENS, chunk=6, stagger=True)
    for ours, theirs in zip(gguf_logits, dir_logits):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    assert gguf_tokens == dir_tokens
    return gguf_tokens


def test_float_experts_gguf_loads_as_the_float_checkpoint(tmp_path):
    config = GPT_OSS_CONFIGS["gpt_oss"]()
    save_random_model(config, tmp_path / "hf")
    assert write_gguf(tmp_path / "hf", config, tmp_path / "model.gguf") == 0
    _assert_loads_alike(load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache")),
                        load_model(str(tmp_path / "hf"), BACKENDS["exact"]))


def test_experts_partly_mxfp4_are_refused(tmp_path):
    config = GPT_OSS_CONFIGS["gpt_oss"]()
    (tmp_path / "hf").mkdir()
    write_mxfp4_checkpoint(tmp_path / "hf")
    write_gguf(tmp_path / "hf", config, tmp_path / "model.gguf", widen=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(ValueError, match="some expert weights MXFP4 and others not"):
        load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))


# per layer, the block format of each expert tensor (K-quants need 256-wide rows: hidden and intermediate 256)
BLOCK_EXPERTS = [{"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                 {"gate": "Q6_K", "up": "Q8_0", "down": "Q4_K"}]


def write_block_experts_gguf(path, config, formats: list[dict[str, str]]):
    """A random GPT-OSS of `config` saved at path / "hf", its experts replaced by random blocks of
    `formats` (per layer, part -> GGUF format) and their gate|up biases made large (the clamps cut:
    the GGUF keeps llama.cpp's 7); the GGUF of it, those experts written as the blocks, at
    path / "model.gguf". Returns the transformers reference (the blocks' dequantised values)."""
    reference = save_random_model(config, path / "hf")
    rng, blocks = np.random.default_rng(0), {}
    E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
    with torch.no_grad():
        for layer, layer_formats in enumerate(formats):
            experts = reference.model.layers[layer].mlp.experts
            dense = {}
            for part, format in layer_formats.items():
                rows, columns = (H, I) if part == "down" else (I, H)
                raw = _blocks(format, E * rows, columns, rng).reshape(E, rows, -1)
                blocks[f"blk.{layer}.ffn_{part}_exps.weight"] = (format, raw)
                dense[part] = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format]))
            gate_up = torch.stack((dense["gate"], dense["up"]), dim=2).reshape(E, 2 * I, H)  # gate at even rows
            experts.gate_up_proj.copy_(gate_up.transpose(1, 2))  # transformers' [E, in, out]
            experts.down_proj.copy_(dense["down"].transpose(1, 2))
            experts.gate_up_proj_bias.normal_(0, config.swiglu_limit)
    reference.save_pretrained(path / "hf")
    write_gguf(path / "hf", config, path / "model.gguf", blocks=blocks)
    return reference


@pytest.mark.skipif(gpt_oss_expert_ops() is None or not hasattr(gpt_oss_expert_ops(), "moe_experts_blocks_gpt_oss"),
                    reason="GPT-OSS's block experts need the native extension")
def test_block_experts_run_from_the_files_blocks(tmp_path):
    config = GPT_OSS_CONFIGS["gpt_oss"](hidden_size=256, intermediate_size=256)
    reference = write_block_experts_gguf(tmp_path, config, BLOCK_EXPERTS)
    from_gguf = load_model(str(tmp_path / "model.gguf"), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"))
    from_dir = load_model(str(tmp_path / "hf"), BACKENDS["exact"])
    experts = [layer.mlp.experts for layer in from_gguf.model.model.layers]
    assert all(type(e) is GptOssGGUFBlockExperts for e in experts)
    assert [[s.format for s in e.block_segments] for e in experts] == [list(f.values()) for f in BLOCK_EXPERTS]
    assert all(p.dim() < 3 for p in from_gguf.model.parameters()), "a float32 expert stack is resident"
    cached = load_file(str(next((tmp_path / "cache").glob("gguf-*")) / "model.safetensors"))
    assert not any(".mlp.experts." in name and not name.endswith("bias") for name in cached)  # no float copy
    prompts = paged_prompts()
    tokens = _assert_runs_alike(from_gguf, from_dir, atol=1e-4)  # the same values; float32 sums in another order
    assert tokens == greedy_tokens(reference_outputs(reference, prompts, NEW_TOKENS))
