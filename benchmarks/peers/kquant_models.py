"""A ~1B-parameter Llama with random weights, as GGUF files in llama.cpp's K-quants, for timing both
engines on weights of a realistic size (the outputs are meaningless; nothing here measures quality).

    python -m benchmarks.peers.kquant_models [--out ~/.cache/blockserve-bench-models] [--layers 16]
        [--types Q4_K_M Q5_K_M Q6_K]            ->  prints one GGUF path per type

Every width is a multiple of 256 (hidden 2048, MLP 5632, 32 heads / 8 KV heads of 64, vocab 49152), so
llama-quantize keeps every tensor in the K-quant the type names instead of falling back to a legacy
quant. The tokenizer is the bundled SmolLM2-135M's (its vocab is 49152), read from its GGUF by
transformers. The checkpoint is written by transformers as float16 safetensors (seed 0), converted by
llama.cpp's own convert_hf_to_gguf.py (from the tree that benchmarks/peers/build_llama_cpp.sh unpacks)
and quantized by its llama-quantize. The converter imports `sentencepiece` (llama.cpp's requirements): a
folder that holds it may be named in PYTHONPATH, which the converter inherits. Files already written are kept.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from blockserve.models.default_model import default_model_path
from benchmarks.peers.native import HERE

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
              vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False)


def write_checkpoint(folder: Path, layers: int) -> None:
    """The random float16 checkpoint and the bundled model's tokenizer, in HF layout."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    bundled = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(bundled.parent, gguf_file=bundled.name)
    if len(tokenizer) != CONFIG["vocab_size"]:
        raise RuntimeError(f"the bundled tokenizer has {len(tokenizer)} tokens, the model {CONFIG['vocab_size']}")
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **CONFIG)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "blockserve-bench-models")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16: 0.92B parameters)")
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K"], help="llama-quantize types")
    args = ap.parse_args()
    stem = f"random-llama-{args.layers}l"
    bin_dir = Path(subprocess.run([str(HERE / "build_llama_cpp.sh"), "native", "llama-quantize"], check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1])
    tree = bin_dir.parent.parent / "src"
    checkpoint, f16 = args.out / stem, args.out / f"{stem}-F16.gguf"
    if not (checkpoint / "model.safetensors").is_file() and not f16.is_file():
        write_checkpoint(checkpoint, args.layers)
    if not f16.is_file():
        # the converter's own gguf package first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env)
    for kind in args.types:
        out = args.out / f"{stem}-{kind}.gguf"
        if not out.is_file():
            subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(out), kind], check=True,
                           capture_output=True)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
