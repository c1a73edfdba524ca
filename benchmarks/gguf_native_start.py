"""Cold start of `blockserve generate` on a GGUF file whose config and tokenizer the loader reads from
the metadata (models/gguf_config.py, gguf_tokenizer.py: no transformers), against the same start
through transformers (the loader's path for the families it does not read itself: the converted
directory in the cache, read back with AutoConfig / AutoTokenizer), side by side, rounds alternating.

Each start is a fresh `python -c` process running `blockserve generate --max-tokens 1` on one
prompt; the figures are the process's wall time (spawn to exit) and, inside it, the time in
load_model (config, tokenizer, weights). The transformers path's cache entry is written by a
warm-up start first (its time is printed too: the first start of a file on that path), so its
measured starts read the entry back, as every later start does.

    python -m benchmarks.gguf_native_start --vocab ggml-vocab-llama-spm.gguf [--rounds 3] [--json x.json]
    python -m benchmarks.gguf_native_start --model FILE.gguf ...

--vocab writes a tiny random Llama (2 layers, 64 wide, float32) carrying that file's tokenizer
metadata (a vocabulary-only GGUF, e.g. llama.cpp's models/ggml-vocab-llama-spm.gguf: Llama 2's
32,000-token SentencePiece vocabulary), so the start is dominated by imports and the tokenizer, not
the weights. The other processes' share of the CPUs is recorded beside each start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from benchmarks.peers.native import CpuShare
from blockserve.bench.common import environment, print_environment, write_json

# the child: one `blockserve generate` start; the transformers path forced where asked; one JSON line
CHILD = r"""
import json, sys, time
begin = time.perf_counter()
from blockserve.models import loader
if sys.argv[2] == "transformers":
    loader.native_gguf = lambda reader, arch: False  # the path of the families not read natively
load, in_load = loader.load_model, [0.0]
def timed_load(*args, **kwargs):
    start = time.perf_counter()
    try:
        return load(*args, **kwargs)
    finally:
        in_load[0] += time.perf_counter() - start
loader.load_model = timed_load
from blockserve.cli import main
rc = main(["generate", "--model", sys.argv[1], "--max-tokens", "1", "--max-model-len", "512",
           "--kv-cache-memory", "32MiB", "--num-threads", "1", "--jsonl", "The capital of France is"])
print(json.dumps({"rc": rc, "load_s": in_load[0], "in_process_s": time.perf_counter() - begin,
                  "transformers_imported": "transformers" in sys.modules}))
"""
PATHS = ("native", "transformers")


def write_tiny_llama(vocab: Path, out: Path, seed: int = 0) -> None:
    """A random 2-layer, 64-wide float32 Llama carrying `vocab`'s tokenizer.* metadata."""
    reader = gguf.GGUFReader(vocab)
    size = len(reader.fields["tokenizer.ggml.tokens"].data)
    hidden, ffn, heads, kv_heads, layers = 64, 128, 4, 2, 2
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, "llama")
    for add, value in ((writer.add_context_length, 512), (writer.add_block_count, layers),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_dimension_count, hidden // heads)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)

    def random(*shape: int) -> np.ndarray:
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)

    writer.add_tensor("token_embd.weight", random(size, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                            ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight",
                              np.ones(shape, dtype=np.float32) if name.endswith("norm") else random(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def one_start(model: Path, path: str, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BLOCKSERVE_CACHE_DIR": str(cache),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with CpuShare() as share:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, str(model), path], capture_output=True, text=True,
                              env=env)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the {path} start failed: {done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    if result["rc"] != 0 or result["transformers_imported"] != (path == "transformers"):
        raise RuntimeError(f"the {path} start did not run as asked: {result}")
    return {**result, "wall_s": wall, "text": json.loads(lines[0])["text"], "other_cpu_share": share.others_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a .gguf file the loader reads natively")
    source.add_argument("--vocab", help="a vocabulary-only .gguf: a tiny random Llama carrying it is measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = environment()
    print_environment(env)
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else Path(scratch) / "tiny-llama.gguf"
        if args.vocab:
            write_tiny_llama(Path(args.vocab), model)
        cache = Path(scratch) / "cache"
        first = {path: one_start(model, path, cache) for path in PATHS}  # warm-up; writes the cache entry
        runs: dict[str, list[dict]] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                runs[path].append(one_start(model, path, cache))
    if runs["native"][0]["text"] != runs["transformers"][0]["text"]:
        raise RuntimeError(f"the two paths generated different text: {runs['native'][0]['text']!r} against "
                           f"{runs['transformers'][0]['text']!r}")
    medians = {path: {key: statistics.median(run[key] for run in runs[path]) for key in ("wall_s", "load_s")}
               for path in PATHS}
    print(f"\n{args.model or args.vocab}: `blockserve generate --max-tokens 1`, 1 thread, medians of {args.rounds}")
    print(f"{'path':<14} {'process wall s':>15} {'load_model s':>13} {'others CPU':>11}")
    for path in PATHS:
        shares = [run["other_cpu_share"] for run in runs[path]]
        print(f"{path:<14} {medians[path]['wall_s']:>15.2f} {medians[path]['load_s']:>13.2f} "
              f"{min(shares):>5.0%}-{max(shares):.0%}")
    print(f"transformers / native: process {medians['transformers']['wall_s'] / medians['native']['wall_s']:.2f}x, "
          f"load {medians['transformers']['load_s'] / medians['native']['load_s']:.2f}x; the transformers path's "
          f"first start (writing its cache entry): {first['transformers']['wall_s']:.2f} s")
    write_json(args.json, {"environment": env, "args": vars(args), "first_start": first, "runs": runs,
                           "medians": medians})


if __name__ == "__main__":
    main()
