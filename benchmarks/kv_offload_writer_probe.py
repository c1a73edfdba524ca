"""What a busy disk-tier writer costs a decode-like step, by where the writer runs.

The step: one torch thread running matrix-vector products over 40 MiB of weights (a memory-bound
decode stand-in) and tanh, timed step by step (wall and the step thread's CPU time). The writer:
DiskTier.write of the bundled model's 16-token blocks (704 KiB: sha256, header, one writev, rename,
the directory's lock), back to back for the whole measurement, run

  none             no writer
  thread, idle     a thread of this process under SCHED_IDLE (the tier's writer)
  thread, normal   a thread of this process at the default policy
  process, idle    a process of its own (same session) under SCHED_IDLE
  process, normal  a process of its own at the default policy

in rounds that run every mode, in a rotated order each round. A thread contends with the step for the
interpreter's lock (GIL), a process does not: at the same policy, the difference between the two is
what the lock costs; the difference between a policy and none, what the CPU time they share costs.
Per mode: the median over rounds of the step's median wall and CPU time, the median of the per-round
ratios against no writer, and blocks written per second.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.kv_offload_writer_probe --json results/kv_offload_writer_probe.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import threading
import time

import torch

from benchmarks.cpu_share import CpuShare
from blockserve.bench.common import environment, percentile, print_environment, write_json
from blockserve.kv.tiers import DiskTier, entry_key

BLOCK_BYTES = 704 * 1024  # a 16-token block of the bundled model's float32 KV
MODES = ("none", "thread, idle", "thread, normal", "process, idle", "process, normal")


def write_blocks(directory: str, idle: bool, stop, written) -> None:
    """Write blocks to a DiskTier at `directory` until `stop` is set; count them in `written`."""
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    tier = DiskTier(directory, 1 << 40)
    payload = bytearray(os.urandom(BLOCK_BYTES))
    n = 0
    while not stop.is_set():
        tier.write(entry_key(b"probe", 0, n.to_bytes(32, "little")), payload)
        n += 1
        written.value = n
    tier.close()


def measure(mode: str, steps: int, weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        writer = None
        if mode != "none":
            kind, policy = mode.split(", ")
            if kind == "thread":
                stop, written = threading.Event(), multiprocessing.Value("q", 0, lock=False)
                writer = threading.Thread(target=write_blocks, args=(directory, policy == "idle", stop, written))
            else:
                context = multiprocessing.get_context("spawn")
                stop, written = context.Event(), context.Value("q", 0, lock=False)
                writer = context.Process(target=write_blocks, args=(directory, policy == "idle", stop, written))
            writer.start()
            while written.value == 0:  # writing: a process has started, imported and written once
                time.sleep(0.01)
            first = written.value
        walls, cpus = [], []
        share = CpuShare()
        began = time.perf_counter()
        with share:
            for _ in range(steps):
                wall, cpu = time.perf_counter(), time.thread_time()
                y = x
                for _ in range(4):
                    for w in weights:
                        y = torch.tanh(y @ w)
                cpus.append(time.thread_time() - cpu)
                walls.append(time.perf_counter() - wall)
        elapsed = time.perf_counter() - began
        rate = 0.0
        if writer is not None:
            rate = (written.value - first) / elapsed
            stop.set()
            writer.join()
    return {"step_ms": percentile(walls, 50) * 1e3, "step_cpu_ms": percentile(cpus, 50) * 1e3,
            "blocks_per_s": rate, "others_cpu_share": share.others}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode and round")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    print_environment(env)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(576, 576, generator=generator) for _ in range(30)]  # 40 MiB, the L3 cache's size
    x = torch.randn(4, 576, generator=generator)
    rounds = []
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        rounds.append({mode: measure(mode, args.steps, weights, x) for mode in order})
        print(f"round {r + 1}: " + "; ".join(f"{m} {rounds[-1][m]['step_ms']:.1f} ms" for m in MODES), flush=True)
    summary = {}
    for mode in MODES:
        summary[mode] = {
            "step_ms": percentile([rd[mode]["step_ms"] for rd in rounds], 50),
            "step_cpu_ms": percentile([rd[mode]["step_cpu_ms"] for rd in rounds], 50),
            "step_ratio": percentile([rd[mode]["step_ms"] / rd["none"]["step_ms"] for rd in rounds], 50),
            "step_cpu_ratio": percentile([rd[mode]["step_cpu_ms"] / rd["none"]["step_cpu_ms"] for rd in rounds], 50),
            "blocks_per_s": percentile([rd[mode]["blocks_per_s"] for rd in rounds], 50),
            "others_cpu_share": [min(rd[mode]["others_cpu_share"] or 0 for rd in rounds),
                                 max(rd[mode]["others_cpu_share"] or 0 for rd in rounds)],
        }
        s = summary[mode]
        print(f"{mode:16} step {s['step_ms']:7.1f} ms ({s['step_ratio']:.2f}x), its CPU {s['step_cpu_ms']:6.1f} ms "
              f"({s['step_cpu_ratio']:.2f}x); writer {s['blocks_per_s']:6.1f} blocks/s; others' CPU share "
              f"{s['others_cpu_share'][0]:.0%}-{s['others_cpu_share'][1]:.0%}")
    write_json(args.json, {"environment": env, "args": vars(args), "summary": summary, "per_round": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
