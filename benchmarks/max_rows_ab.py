"""Where the GGUF blocks should stop serving float32 activations, end to end: the bundled SmolLM2
generating an offline batch with every QuantizedLinear's `max_rows` at 16 against each candidate
and against the values measured as the model loaded (models/row_crossover.py), in one process,
rounds alternating. Past `max_rows` a layer runs the float32 GEMM on its
dequantised copy; up to it, the blocks kernel, and a decode step whose rows every layer serves
runs as one native call (models/llama_decode.py's DecodeStack). Generated tokens per second
(prefill included), medians over --rounds, with the other processes' CPU share.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/max_rows_ab.py --threads 2 --rows 64 128
        [--batch 64] [--input-len 112] [--max-tokens 64] [--rounds 3] [--json results/max_rows_ab.json]

Run with BLOCKSERVE_NATIVE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2 for the AVX2 path on an AVX-512 machine. Note: decode attention hands
batches over to the task pool up to the build's kPoolSeqs (csrc/paged_decode.cpp), which follows
MAX_ROWS; candidates past it run attention on OpenMP.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_share import CpuShare  # noqa: E402

from blockserve import LLM, SamplingParams  # noqa: E402
from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, print_environment, write_json  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.models.quantized_linear import QuantizedLinear  # noqa: E402

BASELINE = 16


def set_max_rows(model: torch.nn.Module, rows: int | dict) -> None:
    """Every QuantizedLinear serves up to `rows` rows (a dict: its own, by module); the cached
    DecodeStack (keyed on them) is dropped."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.max_rows = rows[module] if isinstance(rows, dict) else rows
        module.__dict__.pop("_native_stack", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128], help="candidate max_rows (against 16)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=112)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    loaded = load_model(None, BACKENDS["exact"])  # measures each layer's max_rows (models/row_crossover.py)
    load_s = time.perf_counter() - start
    measured = {m: m.max_rows for m in loaded.model.modules() if isinstance(m, QuantizedLinear)}
    if not measured:
        raise SystemExit("the model has no GGUF blocks in use (no native kernel here?)")
    by_shape = {f"{m.out_features}x{m.in_features}": rows for m, rows in measured.items()}
    print(f"measured max_rows per layer shape (out x in): {by_shape} (model loaded in {load_s:.2f} s)")
    llm = LLM(loaded, max_model_len=512, kv_cache_memory="512MiB", enable_prefix_caching=False)
    env = environment()
    print_environment(env)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[int | str, list[dict]] = {rows: [] for rows in (BASELINE, *args.rows, "measured")}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for rows, figures in runs.items():
            set_max_rows(loaded.model, measured if rows == "measured" else rows)
            with CpuShare() as share:
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            tok_s = args.batch * args.max_tokens / seconds
            print(f"round {round_}: max_rows {rows}: {tok_s:.1f} tok/s (others' CPU share {share.others})", flush=True)
            if round_:
                figures.append({"tok_s": tok_s, "others_cpu_share": share.others})
    base = statistics.median(f["tok_s"] for f in runs[BASELINE])
    summary = {}
    for rows, figures in runs.items():
        median = statistics.median(f["tok_s"] for f in figures)
        summary[rows] = {"median_tok_s": median, "ratio_to_16": median / base}
        print(f"max_rows {rows:>8}: {median:7.1f} tok/s median, {median / base:.2f}x max_rows 16")
    write_json(args.json, {"environment": env, "args": vars(args), "measured_max_rows": by_shape, "load_s": load_s,
                           "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
