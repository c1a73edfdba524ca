"""What sampling costs a decode step: the sampler alone on logits of SmolLM2's vocabulary, then the
bundled SmolLM2's decode step at 1 and 16 running requests, per sampling setting, with the
sampled rows drawn by csrc/sample.cpp ("native") or by the PyTorch ops that run off the CPU
("torch"), in one process, rounds alternating, medians.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/sampler.py [--threads 2] [--rounds 3]
        [--running 1 16] [--json results/sampler.json]

The sampler alone draws from logits ~ N(0, 3^2), a wide distribution: at temperature 0.7 a 0.9
top-p nucleus holds ~240 tokens, at 0.8 a 0.95 one ~1300, so the PyTorch path, which looks among
each row's 256 most likely first, often sorts the whole vocabulary. The decode steps sample from
the model's own logits. On the "torch" path greedy rows take PyTorch's argmax too. Each figure
carries the other processes' CPU share while it was taken (benchmarks/cpu_share.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_share import CpuShare  # noqa: E402
from decode_glue import decoding_engine  # noqa: E402

from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, write_json  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.sampling_params import SamplingParams  # noqa: E402
from blockserve.worker import sampler as sampler_module  # noqa: E402
from blockserve.worker.sampler import Sampler, SamplingBatch, SamplingRow  # noqa: E402

SETTINGS: dict[str, dict] = {
    "greedy": dict(temperature=0),
    "temperature 1": dict(temperature=1.0),  # OpenAI's defaults
    "t 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t 0.8, top-k 40, top-p 0.95, min-p 0.05": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama-server's
}
PATHS = ("native", "torch")
NATIVE_READS = sampler_module.native_reads


def set_path(path: str) -> None:
    """Every Sampler in this process takes `path`: its native calls are gated by native_reads."""
    sampler_module.native_reads = NATIVE_READS if path == "native" else (lambda x, dtype=torch.float32: False)


def sampler_alone(rows: int, setting: dict, rounds: int, calls: int) -> dict[str, float]:
    sampler = Sampler(device="cpu", seed=0)
    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)) * 3
    batch_rows = [SamplingRow(SamplingParams(max_tokens=16, **setting), [1, 2], [3])] * rows
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            set_path(path)
            walls = []
            for _ in range(calls):
                batch = SamplingBatch.build(batch_rows, "cpu")
                start = time.perf_counter()
                sampler(logits, batch)
                walls.append(time.perf_counter() - start)
            times[path].append(statistics.median(walls))
    return {f"{path} us": 1e6 * statistics.median(v) for path, v in times.items()}


def decode_steps(loaded, running: int, setting: dict, rounds: int, steps: int) -> dict[str, float]:
    llm = decoding_engine(loaded, running, 2 * rounds * steps, "auto", setting, adaptive_threads=False)
    engine = llm.engine
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    shares: list[float] = []
    for _ in range(rounds):
        for path in PATHS:
            set_path(path)
            walls = []
            with CpuShare() as share:
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    walls.append(time.perf_counter() - start)
            times[path].append(statistics.median(walls))
            shares.append(share.others or 0.0)
    set_path("native")
    return {**{f"{path} step ms": 1e3 * statistics.median(v) for path, v in times.items()},
            "others_cpu_share": statistics.median(shares)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=20, help="decode steps per path per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"environment": environment(), "args": vars(args), "sampler": [], "decode": []}
    if Sampler(device="cpu").native is None:
        sys.exit("the native kernels are not built here: nothing to compare")

    print(f"sampler alone, V = 49152, logits ~ N(0, 9): median us per call  [{args.threads} thread(s)]")
    for name, setting in SETTINGS.items():
        for rows in args.running:
            row = {"setting": name, "rows": rows, **sampler_alone(rows, setting, args.rounds, 50)}
            results["sampler"].append(row)
            print(f"  {name:40s} {rows:3d} rows: native {row['native us']:9.1f}   torch {row['torch us']:9.1f}"
                  f"   ({row['torch us'] / row['native us']:.1f}x)")

    loaded = load_model(None, BACKENDS["exact"])
    print("decode step, bundled SmolLM2: median ms per step; others' CPU share in brackets")
    for name, setting in SETTINGS.items():
        for running in args.running:
            row = {"setting": name, "running": running, **decode_steps(loaded, running, setting, args.rounds, args.steps)}
            results["decode"].append(row)
            print(f"  {name:40s} {running:3d} running: native {row['native step ms']:7.2f}   torch "
                  f"{row['torch step ms']:7.2f}   [{100 * row['others_cpu_share']:.0f}%]")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
