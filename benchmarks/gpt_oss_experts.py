"""One GPT-OSS MoE layer's experts (gpt_oss.GptOssExperts at gpt-oss-20b's shape: 2880 x 2880 experts,
top-4, random weights; 32 experts in MXFP4, fewer in float32 to bound memory) per forward, its two
routes at a few token counts: `native` (the layer in one call, csrc/moe_experts.cpp's moe_experts_mxfp4
or moe_experts_gpt_oss) and `loop` (a Python loop over the experts picked, MXFP4 projections through
csrc/mxfp4.cpp); with the other processes' CPU share. `--q8-0`: the experts as a llama-quantize
GGUF holds them in Q8_0, run from their blocks (GptOssGGUFBlockExperts: moe_experts_blocks_gpt_oss)
against the same values widened to float32 (moe_experts_gpt_oss), and the bytes each holds.

    python -m benchmarks.gpt_oss_experts [--threads 1] [--tokens 1 16] [--float32 --experts 8] [--q8-0]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.mxfp4_matmul import seconds_per_call
from blockserve.models.gguf_block_experts import GptOssGGUFBlockExperts
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


def random_q8_0(experts: int, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Q8_0 blocks [experts, rows, columns / 32 * 34]: a float16 scale, then 32 int8 values."""
    blocks = rng.integers(-127, 128, (experts, rows, columns // 32, 34), dtype=np.int8).view(np.uint8)
    blocks[..., :2] = np.full(blocks.shape[:-1], 0.002, dtype=np.float16)[..., None].view(np.uint8)
    return blocks.reshape(experts, rows, -1)


def q8_0_pair(count: int, gen: torch.Generator) -> tuple[GptOssGGUFBlockExperts, GptOssExperts]:
    """Q8_0 block experts and the float32 experts of their values (the checkpoint's layout)."""
    rng = np.random.default_rng(0)
    parts = {"gate": random_q8_0(count, INTERMEDIATE, HIDDEN, rng), "up": random_q8_0(count, INTERMEDIATE, HIDDEN, rng),
             "down": random_q8_0(count, HIDDEN, INTERMEDIATE, rng)}
    blocks = GptOssGGUFBlockExperts(*(("Q8_0", torch.from_numpy(raw)) for raw in parts.values()),
                                    hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, alpha=1.702, limit=7.0)
    ops = gpt_oss_expert_ops()
    columns = {"gate": HIDDEN, "up": HIDDEN, "down": INTERMEDIATE}
    dense = {part: torch.stack([ops.gguf_dequantize(torch.from_numpy(raw[e]), "Q8_0", columns[part])
                                for e in range(count)]) for part, raw in parts.items()}
    widened = GptOssExperts(count, HIDDEN, INTERMEDIATE, alpha=1.702, limit=7.0)
    biases = (torch.randn(count, 2 * INTERMEDIATE, generator=gen) / 10, torch.randn(count, HIDDEN, generator=gen) / 10)
    with torch.no_grad():
        gate_up = torch.stack((dense["gate"], dense["up"]), dim=2).reshape(count, 2 * INTERMEDIATE, HIDDEN)
        widened.gate_up_proj.copy_(gate_up.transpose(1, 2))
        widened.down_proj.copy_(dense["down"].transpose(1, 2))
        for module in (blocks, widened):
            module.gate_up_proj_bias.copy_(biases[0])
            module.down_proj_bias.copy_(biases[1])
    return blocks, widened


def routed_tokens(tokens: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states of `tokens` tokens, each routed to TOP_K of `experts` with softmax weights:
    (x, weights, ids)."""
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.rand(tokens, experts, generator=gen).topk(TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)
    return x, weights, ids


def main_q8_0(args, gen: torch.Generator) -> None:
    blocks, widened = q8_0_pair(args.experts, gen)
    held = {"Q8_0": blocks.resident_bytes(), "float32": widened.gate_up_proj.nbytes + widened.down_proj.nbytes}
    print(f"{args.experts} experts of [{2 * INTERMEDIATE}, {HIDDEN}] + [{HIDDEN}, {INTERMEDIATE}], top-{TOP_K}; "
          f"{args.threads} thread(s); Q8_0 {held['Q8_0'] / 2**20:.0f} MiB, float32 {held['float32'] / 2**20:.0f} MiB")
    print("tokens  experts run  Q8_0 blocks ms  float32 ms  max |diff|  others' CPU share")
    for tokens in args.tokens:
        x, weights, ids = routed_tokens(tokens, args.experts, gen)
        with CpuShare() as share, torch.no_grad():
            times = {name: seconds_per_call(lambda m=module: m(x, weights, ids))
                     for name, module in (("blocks", blocks), ("float32", widened))}
            diff = float((blocks(x, weights, ids) - widened(x, weights, ids)).abs().max())
        others = "n/a" if share.others is None else f"{share.others:.0%}"
        print(f"{tokens:6d}  {len(ids.unique()):11d}  {times['blocks'] * 1e3:14.2f}  {times['float32'] * 1e3:10.2f}  "
              f"{diff:10.2e}  {others}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--float32", action="store_true", help="float32 experts instead of MXFP4")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--q8-0", action="store_true",
                        help="Q8_0 GGUF experts from their blocks against their float32 widening (use --experts 8)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if gpt_oss_expert_ops() is None:
        raise SystemExit("native kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    if args.q8_0:
        return main_q8_0(args, gen)
    experts = random_experts(args.experts, not args.float32, gen)
    print(f"{args.experts} experts of [{2 * INTERMEDIATE}, {HIDDEN}] + [{HIDDEN}, {INTERMEDIATE}] "
          f"{'float32' if args.float32 else 'MXFP4'}, top-{TOP_K}; {args.threads} thread(s)")
    print("tokens  experts run  native ms  loop ms  others' CPU share")
    for tokens in args.tokens:
        x, weights, ids = routed_tokens(tokens, args.experts, gen)
        times = {}
        with CpuShare() as share, torch.no_grad():
            for route in ("native", "loop"):
                experts.route = route
                times[route] = seconds_per_call(lambda: experts(x, weights, ids))
        others = "n/a" if share.others is None else f"{share.others:.0%}"
        print(f"{tokens:6d}  {len(ids.unique()):11d}  {times['native'] * 1e3:9.2f}  {times['loop'] * 1e3:7.2f}  {others}")


if __name__ == "__main__":
    main()
