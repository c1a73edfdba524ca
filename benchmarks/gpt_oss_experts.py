"""One GPT-OSS MoE layer's experts (gpt_oss.GptOssExperts at gpt-oss-20b's shape: 2880 x 2880 experts,
top-4, random weights; 32 experts in MXFP4, fewer in float32 to bound memory) per forward, its two
routes at a few token counts: `native` (the layer in one call, csrc/moe_experts.cpp's moe_experts_mxfp4
or moe_experts_gpt_oss) and `loop` (a Python loop over the experts picked, MXFP4 projections through
csrc/mxfp4.cpp); with the other processes' CPU share.

    python -m benchmarks.gpt_oss_experts [--threads 1] [--tokens 1 16] [--float32 --experts 8]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.mxfp4_matmul import seconds_per_call
from blockserve.models.gpt_oss import GptOssExperts, gpt_oss_expert_ops

HIDDEN, INTERMEDIATE, TOP_K = 2880, 2880, 4


def random_experts(count: int, mxfp4: bool, gen: torch.Generator) -> GptOssExperts:
    experts = GptOssExperts(count, HIDDEN, INTERMEDIATE, alpha=1.702, limit=7.0, mxfp4=mxfp4)
    with torch.no_grad():
        for name, parameter in experts.named_parameters():
            if name.endswith("_blocks"):
                parameter.copy_(torch.randint(0, 256, parameter.shape, dtype=torch.uint8, generator=gen))
            elif name.endswith("_scales"):
                parameter.copy_(torch.randint(119, 124, parameter.shape, dtype=torch.uint8, generator=gen))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) / 10)
    return experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--float32", action="store_true", help="float32 experts instead of MXFP4")
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if gpt_oss_expert_ops() is None:
        raise SystemExit("native kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    experts = random_experts(args.experts, not args.float32, gen)
    print(f"{args.experts} experts of [{2 * INTERMEDIATE}, {HIDDEN}] + [{HIDDEN}, {INTERMEDIATE}] "
          f"{'float32' if args.float32 else 'MXFP4'}, top-{TOP_K}; {args.threads} thread(s)")
    print("tokens  experts run  native ms  loop ms  others' CPU share")
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        ids = torch.rand(tokens, args.experts, generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
        times = {}
        with CpuShare() as share, torch.no_grad():
            for route in ("native", "loop"):
                experts.route = route
                times[route] = seconds_per_call(lambda: experts(x, weights, ids))
        others = "n/a" if share.others is None else f"{share.others:.0%}"
        print(f"{tokens:6d}  {len(ids.unique()):11d}  {times['native'] * 1e3:9.2f}  {times['loop'] * 1e3:7.2f}  {others}")


if __name__ == "__main__":
    main()
