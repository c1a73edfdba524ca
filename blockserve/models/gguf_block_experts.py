"""A mixture-of-experts layer's routed experts kept in a GGUF file's blocks: llama.cpp's stacked
`ffn_gate_exps`, `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I], each in its own format,
run in place by csrc/moe_experts.cpp (moe_experts_blocks, which reads every expert's rows through
csrc/gguf_blocks.cpp's entry points), with no float32 copy: the experts stay at their file size.

GGUFBlockExperts replaces a model's moe.Experts (same forward) before its weights load;
GptOssGGUFBlockExperts replaces GPT-OSS's float experts (gpt_oss.GptOssExperts: biases, clamped
SwiGLU; moe_experts_blocks_gpt_oss) where the file holds them in a block format (Q8_0, K-quants:
llama-quantize's output for some mixes) rather than MXFP4. `use_block_experts` does that for every
layer whose three expert tensors are in a block format. `activations` is the engine's
--quantized-activations, as the model's GGUFBlockLinear layers take it: float32; int8 (each token's
input rounded once per block of 32 to int8 levels for all its experts' gate and up, each expert's
intermediate once for its down, integer dots: the bits gguf_matmul_int8 gives those rows); int16
(both rounded to int16 levels, the float dots). Under tensor parallelism each rank keeps its
share of the intermediate size (moe.Experts' or GptOssExperts' shard): whole rows of gate and up
(GPT-OSS's gate|up bias: those entries, still interleaved; its down bias on rank 0), and of down the
columns of its share, which must be whole blocks (gguf_block_linear.shard_blocks: refused, with the
way out, where a share cuts one).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from blockserve.models.gguf_block_linear import KERNEL_FORMATS, Segment, as_tensor, block_shape, shard_blocks
from blockserve.models.gpt_oss import GptOssExperts, expert_biases
from blockserve.models.moe import Experts, expert_ops
from blockserve.models.quantized_linear import ACTIVATIONS, DEFAULT_ACTIVATIONS
from blockserve.tensor_parallel.layers import Slice

PARTS = ("gate", "up", "down")  # the names use_block_experts takes: "<layer>.mlp.experts.<part>"


class GGUFBlockExperts(nn.Module):
    """forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H], as moe.Experts, over `gate`, `up`
    [E, I, row bytes] and `down` [E, H, row bytes] GGUF blocks (format, raw uint8), with `activations`
    (ACTIVATIONS; see the module docstring). With `tp`, the blocks are this rank's share of the
    intermediate size and the output is all-reduced."""

    def __init__(self, gate: tuple[str, torch.Tensor], up: tuple[str, torch.Tensor], down: tuple[str, torch.Tensor],
                 hidden_size: int, intermediate_size: int, what: str = "experts", tp=None,
                 activations: str = DEFAULT_ACTIVATIONS):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"{what}: activations must be one of {ACTIVATIONS}, not {activations!r}")
        self.tp = tp
        self.activations = activations
        self.ops = expert_ops()
        if self.ops is None:
            raise RuntimeError("GGUF block experts need the native extension (AVX2 or AVX-512)")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        expected = {"gate": (intermediate_size, hidden_size), "up": (intermediate_size, hidden_size),
                    "down": (hidden_size, intermediate_size)}
        self.block_segments = []
        for part, (format, raw) in zip(PARTS, (gate, up, down)):
            rows, columns = expected[part]
            if format not in KERNEL_FORMATS:
                raise ValueError(f"{what}.{part}: no block kernel for GGUF format {format} "
                                 f"(read: {', '.join(KERNEL_FORMATS)})")
            values, nbytes = block_shape(format)
            if (raw.dtype != torch.uint8 or raw.dim() != 3 or raw.shape[1] != rows or columns % values
                    or raw.shape[2] != columns // values * nbytes):
                raise ValueError(f"{what}.{part}: {format} blocks of shape {tuple(raw.shape)} do not hold "
                                 f"[experts, {rows}, {columns}] values; the GGUF file does not match the model")
            segment = Segment(format, raw.contiguous())
            self.block_segments.append(segment)
            self.register_buffer(f"{part}_blocks", segment.raw, persistent=False)
        if len({s.raw.shape[0] for s in self.block_segments}) != 1:
            raise ValueError(f"{what}: gate, up and down hold different numbers of experts")
        self.num_experts = self.block_segments[0].raw.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.block_segments
        out = self.ops.moe_experts_blocks(x.float().contiguous(), weights.float().contiguous(), ids.long().contiguous(),
                                          gate.raw, gate.format, up.raw, up.format, down.raw, down.format,
                                          self.intermediate_size, self.activations)
        out = out.to(x.dtype)
        return out if self.tp is None else self.tp.all_reduce(out)

    def resident_bytes(self) -> int:
        return sum(s.raw.numel() for s in self.block_segments)


class GptOssGGUFBlockExperts(GGUFBlockExperts):
    """GPT-OSS's routed experts (gpt_oss.GptOssExperts' forward) over GGUF blocks: `gate`, `up`
    [E, I, row bytes] (llama.cpp's split of the checkpoint's interleaved gate|up) and `down`
    [E, H, row bytes], with the checkpoint's biases as parameters (loaded as GptOssExperts'):
    gate_up_proj_bias [E, 2I] (gate at even entries, up at odd) and down_proj_bias [E, H];
    h = (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit), in the kernel.
    With `tp`, the blocks are this rank's `shard` of the intermediate size, the biases its share
    (gpt_oss.expert_biases: down's on rank 0 only) and the output is all-reduced. `activations` as
    GGUFBlockExperts'."""

    def __init__(self, gate: tuple[str, torch.Tensor], up: tuple[str, torch.Tensor], down: tuple[str, torch.Tensor],
                 hidden_size: int, intermediate_size: int, alpha: float, limit: float, what: str = "experts",
                 tp=None, shard: Slice | None = None, activations: str = DEFAULT_ACTIVATIONS):
        super().__init__(gate, up, down, hidden_size, intermediate_size, what, tp, activations)
        if not hasattr(self.ops, "moe_experts_blocks_gpt_oss"):
            raise RuntimeError("GPT-OSS's GGUF block experts need the native extension's moe_experts_blocks_gpt_oss")
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj_bias, self.down_proj_bias = expert_biases(self.num_experts, intermediate_size, hidden_size,
                                                                    shard, tp)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.block_segments
        out = self.ops.moe_experts_blocks_gpt_oss(
            x.float().contiguous(), weights.float().contiguous(), ids.long().contiguous(),
            gate.raw, gate.format, up.raw, up.format, down.raw, down.format,
            self.gate_up_proj_bias.float().contiguous(), self.down_proj_bias.float().contiguous(),
            self.alpha, self.limit, self.activations).to(x.dtype)
        return out if self.tp is None else self.tp.all_reduce(out)


def use_block_experts(model: nn.Module, blocks: Iterable[tuple[str, str, np.ndarray]],
                      activations: str = DEFAULT_ACTIVATIONS) -> set[str]:
    """Replace `model`'s moe.Experts by GGUFBlockExperts, and GPT-OSS's float GptOssExperts by
    GptOssGGUFBlockExperts (both with `activations`), where the GGUF holds all three of a layer's
    expert tensors in block formats, before its weights load. `blocks`: ("<layer>.mlp.experts.<part>", format, raw [E, rows,
    row bytes]) with part in PARTS. Tensor-parallel experts keep this rank's share (shard_blocks;
    ValueError where it cuts a block). Returns the parameter names now held as blocks (not to load):
    "<layer>.mlp.experts.gate_up_proj" and ".down_proj"."""
    modules = dict(model.named_modules())
    pending: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    taken: set[str] = set()
    for name, format, raw in blocks:
        path, _, part = name.rpartition(".")
        experts = modules.get(path)
        gpt_oss = isinstance(experts, GptOssExperts) and not experts.mxfp4
        if not (isinstance(experts, Experts) or gpt_oss) or format not in KERNEL_FORMATS:
            continue
        parts = pending.setdefault(path, {})
        parts[part] = (format, raw)
        if len(parts) < len(PARTS):
            continue
        if gpt_oss:
            num_experts, hidden, two_i = experts.gate_up_proj.shape
            module = GptOssGGUFBlockExperts(*_this_ranks_experts(experts, parts, path), hidden_size=hidden,
                                            intermediate_size=two_i // 2, alpha=experts.alpha, limit=experts.limit,
                                            what=path, tp=experts.tp, shard=experts.shard, activations=activations)
        else:
            num_experts, two_i, hidden = experts.gate_up_proj.shape
            module = GGUFBlockExperts(*_this_ranks_experts(experts, parts, path), hidden_size=hidden,
                                      intermediate_size=two_i // 2, what=path, tp=experts.tp, activations=activations)
        if module.num_experts != num_experts:
            raise ValueError(f"{path}: the GGUF holds {module.num_experts} experts, the config {num_experts}")
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, module)
        taken.update((f"{path}.gate_up_proj", f"{path}.down_proj"))
    return taken


def _this_ranks_experts(experts: Experts | GptOssExperts, parts: dict[str, tuple[str, np.ndarray]], path: str):
    """(format, blocks) of gate, up and down as this rank holds them: all of them without tensor
    parallelism, else the rows of its intermediate share of gate and up and those columns of down."""
    if experts.tp is None:
        return [(f, as_tensor(r)) for f, r in (parts[p] for p in PARTS)]
    share = experts.shard
    held = []
    for part in PARTS:
        format, raw = parts[part]
        if raw.ndim != 3 or (part != "down" and raw.shape[1] != share.full):
            raise ValueError(f"{path}.{part}: {format} blocks of shape {tuple(raw.shape)} do not hold "
                             f"{share.full} rows (the intermediate size); the GGUF file does not match the model")
        local = raw[:, share.start:share.start + share.size] if part != "down" else \
            shard_blocks(raw, format, share, experts.tp.size, f"{path}.down")
        held.append((format, as_tensor(local)))
    return held
