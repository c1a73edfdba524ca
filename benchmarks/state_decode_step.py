"""What a state layer's decode costs for a verified chain against a plain decode: one layer call
(attention/state_decodes.py) of 1 plain row and of a chain of k + 1 rows, per layer kind at the
shapes of `spec_decode --hybrid` (Gated DeltaNet: 4 value heads of 64 x 64; Mamba2: 8 heads of
64 x 64 state; KDA: 4 heads of 64), with the native recurrence (native/csrc/state_recurrence.cpp)
and with the PyTorch one, the calls alternating in one process.

    python -m benchmarks.state_decode_step [--k 4] [--calls 400]

Prints one JSON line per (layer, recurrence): the median microseconds of a plain call and of a
chain call, their ratio, the CPU flags and the other processes' CPU share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.cpu_share import CpuShare
from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.gated_deltanet import GatedDeltaNet
from blockserve.attention.kda import KimiDeltaAttention
from blockserve.attention.mamba2 import Mamba2
from blockserve.attention.metadata import BatchLayout
from blockserve.bench.common import cpu_simd_flags
from blockserve.native.extension import DISABLE_ENV, state_recurrence_ops


def layers(gen: torch.Generator):
    """(name, layer, tokens(n) -> its inputs, call(inputs, ctx)) per layer kind."""
    gdn = GatedDeltaNet("l", 2, 4, 64, 64, 4, 64, dtype=torch.float32)
    gdn_w = torch.randn(gdn.conv_dim, 4, generator=gen) * 0.5
    yield ("gated_deltanet", gdn,
           lambda n: (torch.randn(n, gdn.conv_dim, generator=gen), -F.softplus(torch.randn(n, 4, generator=gen)),
                      torch.rand(n, 4, generator=gen)),
           lambda inputs, ctx: gdn(*inputs, gdn_w, None, ctx))
    mamba = Mamba2("l", 8, 64, 2, 64, 4, 64, dtype=torch.float32)
    m_w, m_b = torch.randn(mamba.conv_dim, 4, generator=gen) * 0.5, torch.randn(mamba.conv_dim, generator=gen)
    A, D, dt_bias = -torch.rand(8, generator=gen) - 0.1, torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    yield ("mamba2", mamba,
           lambda n: (torch.randn(n, mamba.conv_dim, generator=gen), torch.randn(n, 8, generator=gen)),
           lambda inputs, ctx: mamba(*inputs, m_w, m_b, A, D, dt_bias, ctx))
    kda = KimiDeltaAttention("l", 4, 64, 4, dtype=torch.float32)
    k_w = torch.randn(kda.conv_dim, 4, generator=gen) * 0.5
    yield ("kda", kda,
           lambda n: (torch.randn(n, kda.conv_dim, generator=gen),
                      -F.softplus(torch.randn(n, 4, 64, generator=gen)), torch.rand(n, 4, generator=gen)),
           lambda inputs, ctx: kda(inputs[0], k_w, *inputs[1:], ctx))


def call_us(call, cache, inputs, rows: int) -> float:
    """Microseconds of one layer call over `rows` decode rows of one slot (a chain when rows > 1)."""
    meta = StateMetadata(BatchLayout.build([1] * rows, list(range(8, 8 + rows))), torch.ones(rows, dtype=torch.int64),
                         chains=[(0, rows)] if rows > 1 else [])
    ctx = ForwardContext({"l": cache}, [meta])
    began = time.perf_counter()
    call(inputs, ctx)
    return 1e6 * (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="drafts per verification: a chain has k + 1 rows")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    if state_recurrence_ops() is None:
        raise SystemExit("the native kernels are not built here: nothing to compare")
    flags, switch = cpu_simd_flags(), os.environ.get(DISABLE_ENV)
    for name, layer, tokens, call in layers(torch.Generator().manual_seed(0)):
        cache = StateCache(0, [torch.randn(2, *s) * 0.1 for s in layer.kv_cache_spec(4).shapes])
        one, chain = tokens(1), tokens(args.k + 1)
        times = {(rec, rows): [] for rec in ("native", "torch") for rows in (1, args.k + 1)}
        with CpuShare() as share:
            for _ in range(args.calls):
                for rec, rows in times:
                    os.environ[DISABLE_ENV] = "1" if rec == "native" else "0"
                    times[rec, rows].append(call_us(call, cache, one if rows == 1 else chain, rows))
        if switch is None:
            os.environ.pop(DISABLE_ENV)
        else:
            os.environ[DISABLE_ENV] = switch
        for rec in ("native", "torch"):
            plain, verify = statistics.median(times[rec, 1]), statistics.median(times[rec, args.k + 1])
            print(json.dumps({
                "layer": name, "recurrence": rec, "plain_us": round(plain, 1), f"chain_of_{args.k + 1}_us": round(verify, 1),
                "ratio": round(verify / plain, 2), "others_cpu_share": None if share.others is None else round(share.others, 2),
                "cpu_flags": flags,
            }), flush=True)


if __name__ == "__main__":
    main()
