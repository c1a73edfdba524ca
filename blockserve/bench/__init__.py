"""`blockserve bench`: throughput, latency and serving benchmarks (one module per command).

    blockserve bench throughput [--num-prompts 64] [--max-tokens 128] [--random-input-len N] [--output-json P]
    blockserve bench latency --batch-sizes 1 4 16 [--num-iters 3] [--output-json P]
    blockserve bench serve --base-url http://127.0.0.1:8000 --request-rate 1 2 4 [--plot out.png]
    blockserve bench gpu-check [--device cuda] [--smoke] [--results results/gpu_check]

Every printout and JSON result records the thread settings (torch threads, OMP_NUM_THREADS,
OMP_WAIT_POLICY). Shared pieces: `workloads` (the fixed chat workload, random prompts),
`roofline` (fp32 compute and bandwidth bounds), `common` (environment, percentiles, engines);
`gpu_check` with `tiny_families` is the check a machine with a GPU runs (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse

HELP = "benchmarks: throughput, latency, serve, gpu-check"


def add_bench_parser(sub) -> None:
    """Add `bench` with its subcommands to the CLI's subparsers."""
    from blockserve.bench import gpu_check, latency, serve, throughput

    bench = sub.add_parser("bench", help=HELP,
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    gpu_check.add_parser(bench_sub)
