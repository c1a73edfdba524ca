"""GPT-OSS's GGUF experts (llama.cpp's `gpt-oss` architecture) in the Hugging Face checkpoint's layout
(gpt_oss.py), as models/loader.py reads them.

llama.cpp's converter splits the checkpoint's interleaved gate|up projection and writes [out, in]:

    blk.N.ffn_gate_exps.weight [E, I, H]   .bias [E, I]      gate_up_proj rows / bias entries 0::2
    blk.N.ffn_up_exps.weight   [E, I, H]   .bias [E, I]      gate_up_proj rows / bias entries 1::2
    blk.N.ffn_down_exps.weight [E, H, I]   .bias [E, H]      down_proj

A weight in a float format, or in a block format where the native kernels are off, arrives here
dequantised ([out, in] float32) and leaves as transformers' [E, in, out] (with the native kernels, a
layer's experts in block formats run from the file's blocks instead: gguf_block_experts.py's
GptOssGGUFBlockExperts, and never come here). One in MXFP4 (the converter's output for the released checkpoints)
stays MXFP4: ggml's 17-byte blocks are regrouped into the checkpoint's `_blocks` / `_scales` tensors
(mxfp4.py), the same 4.25 bits a weight, never widened.
"""

from __future__ import annotations

import numpy as np

from blockserve.models.mxfp4 import BLOCK

GGML_MXFP4 = "MXFP4"
GGML_BLOCK_BYTES = 1 + BLOCK // 2  # e8m0 scale, then 16 bytes of e2m1 pairs


def hf_blocks_of_ggml_mxfp4(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [..., N, K/32, 16], scales [..., N, K/32]) of ggml MXFP4 rows raw [..., N, K/32 * 17].

    A ggml block is its e8m0 scale then 16 bytes whose low nibbles hold values 0-15 and high nibbles
    values 16-31; the checkpoint's block holds values 2j (low) and 2j+1 (high) in byte j. Both read
    their e2m1 codes against the same scale (ggml doubles the table and halves the scale)."""
    if raw.dtype != np.uint8 or raw.shape[-1] % GGML_BLOCK_BYTES:
        raise ValueError(f"MXFP4 rows must be uint8 with a multiple of {GGML_BLOCK_BYTES} bytes; "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    groups = raw.reshape(*raw.shape[:-1], raw.shape[-1] // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES)
    scales, packed = groups[..., 0], groups[..., 1:]
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)  # the block's 32 values in order
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(scales)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [E, I, ...] -> [E, 2I, ...] with gate's rows at 0::2 and up's at 1::2 (the checkpoint's
    gate_up order)."""
    if gate.shape != up.shape:
        raise ValueError(f"GPT-OSS GGUF ffn_gate_exps {gate.shape} and ffn_up_exps {up.shape} differ in shape")
    joined = np.stack((gate, up), axis=2)
    return joined.reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def expert_tensors(name: str, halves: dict[str, np.ndarray], mxfp4: bool) -> list[tuple[str, np.ndarray]]:
    """The checkpoint's tensors for one layer's expert tensor `name` ("<layer>.mlp.experts.gate_up_proj",
    "...down_proj" or either with "_bias"), given its GGUF halves by kind ("ffn_gate_exps" and
    "ffn_up_exps", or "ffn_down_exps" alone): floats dequantised [out, in] (or biases [E, out]), or,
    with `mxfp4`, the weights' raw ggml rows."""
    if name.endswith("_bias"):
        joined = halves["ffn_down_exps"] if "ffn_down_exps" in halves else \
            interleave_gate_up(halves["ffn_gate_exps"], halves["ffn_up_exps"])
        return [(name, joined)]
    if "ffn_down_exps" in halves:
        weight = halves["ffn_down_exps"]
    else:
        weight = interleave_gate_up(halves["ffn_gate_exps"], halves["ffn_up_exps"])
    if not mxfp4:
        return [(name, np.ascontiguousarray(weight.swapaxes(1, 2)))]  # [E, out, in] -> transformers' [E, in, out]
    blocks, scales = hf_blocks_of_ggml_mxfp4(weight)
    return [(f"{name}_blocks", blocks), (f"{name}_scales", scales)]
