"""Where a blockserve start goes, stage by stage: a fresh Python process per round imports torch,
then blockserve's engine, loads the model (config, tokenizer, weights; the row crossover timed on
its own), starts the engine and generates one greedy token, timing each stage in order. It also
records whether transformers was imported and the process's peak RSS. Run it with the model's cache
entry already written and the native kernels already built (a warm-up round runs first, not kept).

    python -m benchmarks.cold_start_stages [--model FILE.gguf] [--rounds 3] [--kv-cache-memory 32MiB]
        [--json results/x.json]

The other processes' share of the CPUs during each round is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.cold_start import KV_CACHE_MEMORY
from benchmarks.peers.native import CpuShare
from blockserve.bench.common import environment

# the child: one start, stage by stage; prints one JSON line
CHILD = r"""
import json, resource, sys, time
marks = [("start", time.perf_counter())]
def mark(name):
    marks.append((name, time.perf_counter()))
import torch
torch.set_num_threads(int(sys.argv[2]))
mark("import torch")
from blockserve.engine.llm import LLM
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.config import EngineConfig
from blockserve.models import loader
from blockserve.sampling_params import SamplingParams
mark("import blockserve engine")
crossover = [0.0]
measure = loader.measure_max_rows
def timed_measure(model, *args):
    begin = time.perf_counter()
    measure(model, *args)
    crossover[0] += time.perf_counter() - begin
loader.measure_max_rows = timed_measure
loaded = loader.load_model(sys.argv[1] or None, BACKENDS[EngineConfig().attention_backend])
mark("load model (config, tokenizer, weights, row crossover)")
llm = LLM(loaded, max_model_len=512, kv_cache_memory=sys.argv[3])
mark("engine start")
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
mark("first token")
stages = {b[0]: b[1] - a[1] for a, b in zip(marks, marks[1:])}
print(json.dumps({"stages_s": stages, "row_crossover_s": crossover[0], "total_s": marks[-1][1] - marks[0][1],
                  "transformers_imported": "transformers" in sys.modules,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "text": out[0].outputs[0].text}))
"""


def one_start(model: str, threads: int, kv_cache_memory: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with CpuShare() as share:
        done = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), kv_cache_memory], capture_output=True, text=True,
                              env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the start failed: {done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "other_cpu_share": share.others_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a .gguf file or model directory; default: the bundled model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default=KV_CACHE_MEMORY,
                        help="the KV cache budget: 512 tokens of the model (float32) fit in it")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    one_start(args.model, args.threads, args.kv_cache_memory)  # warm-up: page cache, the model's cache entry
    runs = [one_start(args.model, args.threads, args.kv_cache_memory) for _ in range(args.rounds)]
    medians = {stage: statistics.median(run["stages_s"][stage] for run in runs) for stage in runs[0]["stages_s"]}
    print(f"{args.model or 'bundled model'}, {args.threads} thread(s), medians of {args.rounds} starts")
    for stage, seconds in medians.items():
        print(f"  {stage:<58} {seconds:6.2f} s")
    print(f"  {'of which the row crossover':<58} {statistics.median(r['row_crossover_s'] for r in runs):6.2f} s")
    print(f"  {'total':<58} {statistics.median(r['total_s'] for r in runs):6.2f} s")
    print(f"  transformers imported: {runs[0]['transformers_imported']}; peak RSS "
          f"{statistics.median(r['peak_rss_mib'] for r in runs):.0f} MiB; others' CPU share "
          f"{min(r['other_cpu_share'] for r in runs):.0%}-{max(r['other_cpu_share'] for r in runs):.0%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"environment": environment(), "args": vars(args), "runs": runs,
                                               "median_stages_s": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()
