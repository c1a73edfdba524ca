"""What building the flex backend's block mask costs per step and attention group, by cache size.

`flex_attention.step_mask` runs once per step and group before the first layer: on CUDA over the
whole cache as one KV sequence of `--num-pages` pages. This times it for a decode batch of `--batch`
requests with `--context` tokens each, and a `--prefill`-token chunk of one more request beside them,
whose tables are `--width` columns wide (the step's, or with `--captured` a captured graph's capacity),
on `--device`, as CUDA takes it on every device (the whole cache, eager or captured). Median ms over
`--reps`; on CUDA also the peak memory it allocated. Compare two commits by running this from each checkout in
turn (PYTHONPATH=<checkout>):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flex_step_mask.py [--batch 256] [--context 1024]
        [--width 64] [--num-pages 250000] [--prefill 0] [--block-size 16] [--captured] [--device cpu] [--reps 20]
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

from blockserve.attention.flex_attention import step_mask  # noqa: E402
from blockserve.attention.metadata import AttentionMetadata, BatchLayout  # noqa: E402


def step_metadata(batch: int, context: int, prefill: int, width: int, num_pages: int, bs: int,
                  captured: bool) -> AttentionMetadata:
    """`batch` decodes at `context` tokens, then one `prefill`-token chunk after `context` tokens,
    each on distinct random pages; tables `width` columns wide, null-padded."""
    query_lens = [1] * batch + ([prefill] if prefill else [])
    computed = [context] * len(query_lens)
    needs = [-(-(c + q) // bs) for c, q in zip(computed, query_lens)]
    if max(needs) > width or sum(needs) >= num_pages:
        raise ValueError(f"--width {width} must hold {max(needs)} columns and --num-pages {num_pages} "
                         f"more than the {sum(needs)} pages in use")
    pages = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0))[:sum(needs)] + 1).tolist()
    table = torch.zeros(len(needs), width, dtype=torch.int64)
    start = 0
    for row, n in enumerate(needs):
        table[row, :n] = torch.tensor(pages[start:start + n])
        start += n
    meta = AttentionMetadata.build(BatchLayout.build(query_lens, computed), table, bs)
    meta.static_shapes = captured
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=250_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--captured", action="store_true", help="as a captured step builds it (a decode batch only)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    meta = step_metadata(args.batch, args.context, args.prefill, args.width, args.num_pages, args.block_size,
                         args.captured)
    on_cuda = device.type == "cuda"
    times = []
    with CpuShare() as share:
        for _ in range(args.reps + 1):
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            mask = step_mask(meta, args.num_pages, device, compact=False)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del mask
    peak = f"; peak allocated {(torch.cuda.max_memory_allocated() - before) / 2**20:.1f} MiB" if on_cuda else ""
    print(f"step_mask{' (captured)' if args.captured else ''}: batch {args.batch} at {args.context} tokens, "
          f"prefill {args.prefill}, width {args.width}, "
          f"{args.num_pages} pages of {args.block_size} on {device}: median {1e3 * statistics.median(times[1:]):.3f} ms"
          f"{peak}; others' CPU share {share.others}")


if __name__ == "__main__":
    main()
