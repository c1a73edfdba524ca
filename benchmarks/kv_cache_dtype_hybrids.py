"""Quantized KV caches on hybrid shapes: teacher-forced next-token distributions against the float32
cache, the attention layers' K/V quantized while the recurrent states stay float32.

    python -m benchmarks.kv_cache_dtype_hybrids [--families qwen3_next granitemoehybrid] [--seqs 4]
        [--length 256] [--prefill 64] [--threads 1] [--json results/kv_cache_dtype_hybrids.json]

Each family's shape is benchmarks.spec_decode's (8 layers, 3 of every 4 recurrent: Gated DeltaNet
or Mamba2; 2 attention layers of 2 KV heads of 64; hidden 256, vocab 4096) with random weights, and
a random Llama of the same widths (8 attention layers) beside them for scale. Per KV dtype, --seqs
random token sequences of --length: the first --prefill tokens in one step, then one token a step,
each reading the cache as a decode does. Mean and max KL(float32 cache || dtype) over every
position, and the share of positions whose most likely token agrees. Random weights make a model
more sensitive to its cache than a trained one (docs/cpu.md compares both on the bundled model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.spec_decode import hybrid_config
from blockserve.attention.context import ForwardContext, StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.bench.common import environment
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import LinearStateSpec, cdiv, with_kv_cache_dtype
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.worker.kv_tensors import KVCacheTensors

BLOCK = 16
DTYPES = ("int8", "fp8", "int4", "k8v4")


def llama_config():
    """A random Llama of the hybrid shapes' widths, every layer attention."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


@torch.inference_mode()
def teacher_forced_logprobs(model, dtype: str | None, tokens: list[list[int]], prefill: int) -> torch.Tensor:
    """Log-probabilities [seqs x length, vocab] of every position, the model's attention K/V stored as
    `dtype` (None: float32) and its states in float32, each sequence on blocks and a state slot of its own."""
    seqs, length = len(tokens), len(tokens[0])
    layers: dict = {}
    for name, spec in model.kv_cache_specs(BLOCK).items():
        layers.setdefault(spec if dtype is None else with_kv_cache_dtype(spec, dtype), []).append(name)
    per_seq = cdiv(length, BLOCK)
    groups = tuple(KVCacheGroup(spec, seqs + 1 if isinstance(spec, LinearStateSpec) else seqs * per_seq + 1,
                                False, tuple(names)) for spec, names in layers.items())
    kv = KVCacheTensors(KVCacheConfig(groups), device="cpu")
    tables = torch.arange(1, seqs * per_seq + 1).view(seqs, per_seq)
    slots = torch.arange(1, seqs + 1)
    out = torch.empty(seqs, length, model.config.vocab_size)
    computed = 0
    for end in [prefill, *range(prefill + 1, length + 1)]:
        layout = BatchLayout.build([end - computed] * seqs, [computed] * seqs)
        metadata = [StateMetadata(layout, slots) if g.is_state else AttentionMetadata.build(layout, tables, BLOCK)
                    for g in groups]
        ids = torch.tensor([t for row in tokens for t in row[computed:end]])
        logits = model.compute_logits(model(ids, layout.positions, ForwardContext(kv.layer_caches(), metadata)))
        out[:, computed:end] = logits.float().view(seqs, end - computed, -1).log_softmax(-1)
        computed = end
    return out.flatten(0, 1)


def measure(config, args) -> dict:
    """Per KV dtype: KL and top-1 agreement against the float32 cache on a random model of `config`."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (args.seqs, args.length), generator=gen).tolist()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(config, Path(tmp))
        model = load_model(tmp, BACKENDS["exact"]).model
        reference = teacher_forced_logprobs(model, None, tokens, args.prefill)
        for dtype in DTYPES:
            got = teacher_forced_logprobs(model, dtype, tokens, args.prefill)
            kl = (reference.exp() * (reference - got)).sum(-1)
            results[dtype] = {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
                              "top1_agreement": (reference.argmax(-1) == got.argmax(-1)).float().mean().item(),
                              "positions": kl.numel()}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["qwen3_next", "granitemoehybrid", "llama"],
                    choices=["qwen3_next", "granitemoehybrid", "llama"])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 0 < args.prefill < args.length:
        ap.error("--prefill must be in [1, --length)")
    torch.set_num_threads(args.threads)
    results: dict = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    for family in args.families:
        config = llama_config() if family == "llama" else hybrid_config(family)
        results[family] = measure(config, args)
        for dtype, r in results[family].items():
            print(f"{family:17s} {dtype:5s} mean KL {r['mean_kl']:.5f}  max {r['max_kl']:.3f}  "
                  f"top-1 {r['top1_agreement']:.3f}  over {r['positions']} positions", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
