"""Where a blockserve start goes, stage by stage: a fresh Python process per round imports torch,
then blockserve's engine (both with the garbage collector paused where the tree has
blockserve/startup_gc.py, as `blockserve generate` imports them), loads the model (config,
tokenizer, weights; the row crossover timed on its own), starts the engine and generates one greedy
token, timing each stage in order. It also records whether transformers was imported and the
process's peak RSS. Run it with the model's cache entry already written and the native kernels
already built (a warm-up round runs first, not kept); the modules start from compiled bytecode, as
an installed package's do.

    python -m benchmarks.cold_start_stages [--model FILE.gguf] [--rounds 3] [--kv-cache-memory 32MiB]
        [--serve] [--baseline DIR] [--json results/x.json]

--serve: the start `blockserve serve` makes besides (the server's modules imported with their pydantic
models deferred as cli.py imports them, its app built, the start-up heap frozen: server/app.py),
without the HTTP server itself.
--baseline DIR: the blockserve source tree in DIR (an earlier commit's checkout) measured too, its
rounds alternating with this tree's. The other processes' share of the CPUs during each round is
recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.cold_start import KV_CACHE_MEMORY, compiled
from benchmarks.peers.native import CpuShare
from blockserve.bench.common import environment

HERE = Path(__file__).resolve().parents[1]  # this blockserve tree

# the child: one start, stage by stage; prints one JSON line
CHILD = r"""
import contextlib, json, resource, sys, time
marks = [("start", time.perf_counter())]
def mark(name):
    marks.append((name, time.perf_counter()))
serve = sys.argv[4] == "serve"
try:  # the start the CLI makes: blockserve generate pauses the collector, serve also freezes the imports
    from blockserve.startup_gc import frozen_imports, paused_collection
    importing = frozen_imports if serve else paused_collection
except ImportError:  # a tree without it
    importing = contextlib.nullcontext
with importing():
    import torch
    mark("import torch")
    from blockserve.engine.llm import LLM
    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.engine.config import EngineConfig
    from blockserve.models import loader
    from blockserve.sampling_params import SamplingParams
    mark("import blockserve engine")
    if serve:
        try:  # serve's own: the server's pydantic models build on first use
            from blockserve.server.deferred_schemas import deferred_schemas
        except ImportError:  # a tree without it
            deferred_schemas = contextlib.nullcontext
        with deferred_schemas():
            from blockserve.server.app import create_app, freeze_startup_heap
            from blockserve.server.config import ServerConfig
        mark("import the server (fastapi, routes)")
torch.set_num_threads(int(sys.argv[2]))
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
if serve:
    create_app(llm.engine, ServerConfig())
    freeze_startup_heap()
    mark("server app, start-up heap frozen")
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
mark("first token")
stages = {b[0]: b[1] - a[1] for a, b in zip(marks, marks[1:])}
print(json.dumps({"stages_s": stages, "row_crossover_s": crossover[0], "total_s": marks[-1][1] - marks[0][1],
                  "transformers_imported": "transformers" in sys.modules,
                  "blockserve": sys.modules["blockserve"].__file__,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "text": out[0].outputs[0].text}))
"""


def one_start(tree: Path, model: str, threads: int, kv_cache_memory: str, serve: bool) -> dict:
    """One start of the blockserve in `tree` (the child runs there: `python -c` puts the working
    directory first on the import path)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(tree)}
    with CpuShare() as share:
        done = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), kv_cache_memory,
                               "serve" if serve else "generate"],
                              capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"the start failed: {done.stderr[-3000:]}")
    run = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(run["blockserve"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the start meant for {tree} imported {run['blockserve']}")
    return {**run, "other_cpu_share": share.others_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a .gguf file or model directory; default: the bundled model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default=KV_CACHE_MEMORY,
                        help="the KV cache budget: 512 tokens of the model (float32) fit in it")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another blockserve source tree (an earlier commit's checkout), rounds alternating")
    parser.add_argument("--serve", action="store_true",
                        help="also import the server and build its app, as `blockserve serve` starts")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"this tree": HERE}
    if args.baseline is not None:
        if not (args.baseline / "blockserve" / "cli.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: no blockserve/cli.py there; give a blockserve source tree")
        trees["baseline"] = args.baseline.resolve()
    for tree in trees.values():
        compiled(tree)
        one_start(tree, args.model, args.threads, args.kv_cache_memory, args.serve)  # warm-up: page cache, caches
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(one_start(tree, args.model, args.threads, args.kv_cache_memory, args.serve))
    medians = {name: {stage: statistics.median(run["stages_s"][stage] for run in rs) for stage in rs[0]["stages_s"]}
               for name, rs in runs.items()}
    print(f"{args.model or 'bundled model'}, {args.threads} thread(s), medians of {args.rounds} starts")
    print(f"  {'stage':<58} " + " ".join(f"{name:>10}" for name in trees))
    for stage in medians["this tree"]:
        print(f"  {stage:<58} " + " ".join(f"{medians[name][stage]:9.2f}s" for name in trees))
    for label, key in (("of which the row crossover", "row_crossover_s"), ("total", "total_s"),
                       ("peak RSS, MiB", "peak_rss_mib")):
        print(f"  {label:<58} " + " ".join(f"{statistics.median(r[key] for r in runs[name]):10.2f}" for name in trees))
    for name, rs in runs.items():
        print(f"  {name}: transformers imported: {rs[0]['transformers_imported']}; others' CPU share "
              f"{min(r['other_cpu_share'] for r in rs):.0%}-{max(r['other_cpu_share'] for r in rs):.0%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"environment": environment(), "args": vars(args), "runs": runs,
                                               "median_stages_s": medians}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
