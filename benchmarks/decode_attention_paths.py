"""The native decode kernel (attention/csrc/paged_decode.cpp) as built for this CPU against its
portable path (the same source built with -mno-avx2 -mno-avx512f: loops the compiler vectorises,
float32 caches only), per cache dtype: decode_kernels.py's shape (64 sequences of 60-245 tokens,
SmolLM2's 9 query and 3 KV heads of 64), 30 layers' caches read in turn (DRAM) or one layer 30
times (L3). Rounds alternate; medians; the other processes' CPU share recorded.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_attention_paths.py [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_share import CpuShare  # noqa: E402
from decode_kernels import SEQS, decode_problem, time_decode_kernels  # noqa: E402

from blockserve.native import extension as native  # noqa: E402
from blockserve.bench.common import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lens, table, caches, q, out, starts = decode_problem()
    portable = native._native(("-mno-avx2", "-mno-avx512f"))
    kernels = {"this CPU's build": native.paged_decode_kernel(),
               "portable path": None if portable is None else native.PagedDecodeKernel(portable)}
    with CpuShare() as share:
        times = time_decode_kernels(kernels, args.rounds, (lens, table, caches, q, out, starts))
    print(f"decode attention, one layer: {SEQS} sequences, {int(lens.sum())} keys, 1 thread; "
          f"others' CPU share {100 * (share.others or 0):.0f}%")
    medians = {label: 1e3 * statistics.median(v) for label, v in times.items()}
    for label, ms in medians.items():
        print(f"  {label:<40} {ms:6.3f} ms per layer")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "others_cpu_share": share.others,
                                               "ms_per_layer": medians,
                                               "rounds_ms": {k: [1e3 * x for x in v] for k, v in times.items()}},
                                              indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
