"""OpenMP thread policy against decode speed: the bundled SmolLM2's decode step at 1 and 16 running
requests, under each (threads, OMP_WAIT_POLICY / GOMP_SPINCOUNT) setting, in fresh processes (the
OpenMP runtime reads its environment once, when torch loads), settings alternating round by round,
medians. Each figure carries the other processes' CPU share while it was taken.

    python -m benchmarks.thread_policy [--rounds 2] [--busy-neighbours 1] [--neighbour-share 0.5]
        [--json results/thread_policy.json]

`--busy-neighbours N` runs N processes on the CPU for the whole measurement: a loaded machine; each
spins for `--neighbour-share` of every 10 ms (default 1: all the time) and sleeps the rest. The
engine's thread governor is off: each setting runs at its own thread count.

    PASSIVE          a waiting thread sleeps at once: every parallel region pays a futex wake-up
    spin 10k         GOMP_SPINCOUNT=10000: spins ~10 us, then sleeps
    spin 100k        GOMP_SPINCOUNT=100000: spins ~0.1-1 ms, then sleeps
    default          libgomp's default: spins 300k iterations (~0.1-1 ms), then sleeps
    ACTIVE           spins forever: the fastest on an idle machine, a collapse beside a busy neighbour
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SETTINGS: dict[str, tuple[int, dict[str, str]]] = {
    "1 thread, PASSIVE": (1, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, spin 10k": (2, {"GOMP_SPINCOUNT": "10000"}),
    "2 threads, spin 100k": (2, {"GOMP_SPINCOUNT": "100000"}),
    "2 threads, default spin": (2, {}),
    "2 threads, ACTIVE": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
}
# A process on the CPU for a share (argv[1]) of every 10 ms.
NEIGHBOUR = """
import sys, time
busy = float(sys.argv[1]) * 0.01
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    if busy < 0.01:
        time.sleep(0.01 - busy)
"""
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
ROOT = Path(__file__).resolve().parents[1]  # where `python -m benchmarks.thread_policy` finds the package


def child(threads: int, running: list[int], steps: int) -> None:
    """Measure in this process (its environment already set) and print one JSON line."""
    import time

    import torch

    from benchmarks.cpu_share import CpuShare
    from benchmarks.step_profile import decoding_engine
    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.models.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(None, BACKENDS["exact"])
    out = {}
    for n in running:
        llm = decoding_engine(loaded, n, steps, "auto", adaptive_threads=False)
        walls = []
        with CpuShare() as share:
            for _ in range(steps):
                start = time.perf_counter()
                llm.engine.step()
                walls.append(time.perf_counter() - start)
        out[n] = {"step_ms": 1e3 * statistics.median(walls), "others_cpu_share": share.others}
        del llm
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--busy-neighbours", type=int, default=0, help="processes that keep a CPU busy meanwhile")
    ap.add_argument("--neighbour-share", type=float, default=1.0,
                    help="the share of every 10 ms each neighbour spins (it sleeps the rest)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.running, args.steps)
    runs: dict[str, list[dict]] = {name: [] for name in args.settings}
    if not 0 < args.neighbour_share <= 1:
        ap.error("--neighbour-share must be in (0, 1]")
    neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(args.neighbour_share)])
                  for _ in range(args.busy_neighbours)]
    try:
        measure(args, runs)
    finally:
        for proc in neighbours:
            proc.kill()
    report(args, runs)


def measure(args, runs: dict[str, list[dict]]) -> None:
    for _ in range(args.rounds):
        for name in args.settings:
            threads, env = SETTINGS[name]
            full_env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
            full_env.update(env, OMP_NUM_THREADS=str(threads))
            cmd = [sys.executable, "-m", "benchmarks.thread_policy", "--child", str(threads), "--steps", str(args.steps),
                   "--running", *map(str, args.running)]
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, check=True, cwd=ROOT)
            line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
            runs[name].append(json.loads(line.removeprefix("RESULT ")))
            print(f"  round {len(runs[name])}, {name}: {line.removeprefix('RESULT ')}", flush=True)


def report(args, runs: dict[str, list[dict]]) -> None:
    table = {}
    print(f"decode step, median of {args.rounds} round(s) x {args.steps} steps; others' CPU share in brackets")
    for name, results in runs.items():
        table[name] = {}
        cells = []
        for n in args.running:
            ms = statistics.median(r[str(n)]["step_ms"] for r in results)
            share = statistics.median(r[str(n)]["others_cpu_share"] or 0.0 for r in results)
            table[name][n] = {"step_ms": ms, "others_cpu_share": share}
            cells.append(f"{n:3d} running {ms:8.2f} ms [{100 * share:3.0f}%]")
        print(f"  {name:<26} " + "   ".join(cells))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        from blockserve.bench.common import environment

        Path(args.json).write_text(json.dumps({"environment": environment(), "args": vars(args), "settings": {k: SETTINGS[k] for k in args.settings},
                                               "runs": runs, "medians": table}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
