"""Mixture-of-experts pieces the families share: the stacked routed experts; the softmax-routed
sparse MoE of Mixtral, Qwen2-MoE, Qwen3-MoE and Qwen3-Next; and DeepSeek-V3's MoE (also Kimi
Linear's) with its sigmoid, group-limited top-k router.

    SparseMoe(x) = Σ_top-k weight_e · expert_e(x)  [+ sigmoid(shared_expert_gate(x)) · shared_expert(x)]

    weights, experts = top-k of softmax(gate(x)) in fp32, / their sum if normalised

    DeepseekMoE(x) = shared_experts(x) + Σ_top-k weight_e · expert_e(x)

    scores = sigmoid(gate(x))                       fp32, [T, E]
    choice = scores + e_score_correction_bias       used to pick experts, never as weights
    groups: E split into n_group; a group's score = sum of its top-2 choices; keep topk_group
    experts: the top num_experts_per_tok choices within the kept groups
    weights = their scores, / their sum if norm_topk_prob, × routed_scaling_factor

(exactly as transformers' DeepseekV3TopkRouter). Granite's router (softmax over the top-k logits)
stays in its file.

Tensor-parallel (a group `tp`): every expert's intermediate size is sharded (gate | up by rows,
down by columns), the router is whole on every rank (so every rank routes alike), and the routed
experts' partial sums are all-reduced once; the shared experts are a tensor-parallel GatedMLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.tensor_parallel.layers import even_slice
from blockserve.models.layers import GatedMLP
from blockserve.native.extension import quantized_matmul_ops


def expert_ops():
    """The native module when it has csrc/moe_experts.cpp's kernels, else None."""
    ops = quantized_matmul_ops()
    return ops if ops is not None and hasattr(ops, "moe_experts") else None


class Experts(nn.Module):
    """Routed SwiGLU experts, stacked: gate_up_proj [E, 2I, H] (gate | up), down_proj [E, H, I].

    forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]: Σ over each token's k experts of
    weight · down(silu(gate x) * up x). Three routes compute it (equal up to rounding):

        native    csrc/moe_experts.cpp: the pairs grouped by expert and every expert run in one
                  call (a decode step's experts as one job over all their weight rows); the
                  CPU's route in float32 where the native kernels are built (measured at
                  benchmarks.moe's shape, 16 experts of 2048 x 768, top-8, 2 contended threads,
                  medians: 4 tokens 57 ms, the grouped route 296 ms; 16 tokens 178 ms, 222 ms)
        loop      one matmul pair per expert some token picked; reads `ids` on the host (the
                  CPU's route in other dtypes or without the native kernels)
        grouped   the (token, expert) pairs sorted by expert, two torch._grouped_mm calls over
                  the experts' row ranges: nothing read back to the host (the route off the CPU
                  in bfloat16, the dtype CUDA's grouped_mm takes; other dtypes there loop)

    `route`: None picks by device and dtype; a name in ROUTES forces one (grouped runs on the CPU
    in any float dtype; native needs float32 on the CPU)."""

    ROUTES = ("native", "loop", "grouped")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.tp = tp
        self.route: str | None = None
        self.shard = None if tp is None else even_slice(intermediate_size, tp, "moe_intermediate_size")
        local = intermediate_size if tp is None else self.shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        if tp is not None:
            self.gate_up_proj.weight_loader = self._narrow_gate_up
            self.down_proj.weight_loader = self._narrow_down

    def _narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if tensor.shape[dim] != self.shard.full:
            raise ValueError(f"checkpoint expert tensor of shape {tuple(tensor.shape)} does not have "
                             f"moe_intermediate_size = {self.shard.full} along dim {dim}")
        return tensor.narrow(dim, self.shard.start, self.shard.size).clone()

    def _narrow_gate_up(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        """One expert's gate or up [I, H] (part=0 or 1), or the whole stack [E, 2I, H] (part=None)."""
        if part is not None:
            return self._narrow(tensor, 0)
        return torch.cat([self._narrow(half, 1) for half in tensor.chunk(2, dim=1)], dim=1)

    def _narrow_down(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        """One expert's down [H, I], or the whole stack [E, H, I]."""
        return self._narrow(tensor, tensor.dim() - 1)

    def _route_for(self, x: torch.Tensor) -> str:
        if self.route is not None:
            return self.route
        if x.device.type != "cpu":
            return "grouped" if x.dtype == torch.bfloat16 else "loop"
        return "native" if x.dtype == torch.float32 and expert_ops() is not None else "loop"

    def cuda_graph_blocker(self) -> str | None:
        """Why a decode step through these experts cannot be captured as a CUDA graph (None: it can)."""
        if self._route_for(self.gate_up_proj) == "grouped":
            return None
        return (f"MoE experts in {str(self.gate_up_proj.dtype).removeprefix('torch.')} take the expert loop, "
                "which reads the routing back to the host (use --dtype bfloat16)")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        route = self._route_for(x)
        if route not in self.ROUTES:
            raise ValueError(f"unknown expert route {route!r}; choose one of {self.ROUTES} (or None: by device)")
        out = {"native": self._native, "grouped": self._grouped, "loop": self._loop}[route](x, weights, ids)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ops = expert_ops()
        if ops is None or x.device.type != "cpu" or self.gate_up_proj.dtype != torch.float32:
            raise RuntimeError("the native expert route needs float32 experts on the CPU and the native kernels")
        return ops.moe_experts(x.float().contiguous(), weights.float().contiguous(), ids.long().contiguous(),
                               self.gate_up_proj.data.contiguous(),
                               self.down_proj.data.contiguous()).to(x.dtype)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # only the experts some token picked, in id order
            tokens, slot = torch.where(ids == e)  # a token meets each expert at most once
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sync-free: pairs sorted by expert (stably, so each token still sums its experts in id
        order); expert e's rows end at offsets[e] (int32, as grouped_mm takes them)."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        tokens = order // ids.shape[1]
        gate_up = torch._grouped_mm(x[tokens], self.gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


class GroupLimitedRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k (see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the number of experts ({self.num_experts})")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, self.num_groups, self.num_experts // self.num_groups).topk(2, dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        expert_mask = group_mask.repeat_interleave(self.num_experts // self.num_groups, dim=1)
        ids = choice.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup | None = None):
        super().__init__()
        self.gate = GroupLimitedRouter(config)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.moe_intermediate_size, tp)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                       tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)


def softmax_top_k(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k]): the top k of the softmax
    over all experts, computed in float32, divided by their sum when `normalize` (transformers'
    Mixtral, Qwen2-MoE and Qwen3-MoE routers)."""
    weights, ids = F.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sparse_layer(config, layer_idx: int) -> bool:
    """Qwen's rule for which layers are MoE (Qwen2-MoE, Qwen3-MoE, Qwen3-Next): the model has experts,
    the layer is not in `mlp_only_layers`, and it is every `decoder_sparse_step`-th; the others are dense."""
    return (config.num_experts > 0 and layer_idx not in (config.mlp_only_layers or [])
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class SparseMoe(nn.Module):
    """The softmax-routed MoE (module docstring): `gate` the router [E, H], `experts` stacked, and a
    `shared_expert` with its `shared_expert_gate` [1, H] where `shared_intermediate_size` is set.
    The routing weights scale the experts in x's dtype (Qwen) or in float32 (`float32_weights`:
    Mixtral), as transformers rounds them. The router and the shared gate are whole on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *, normalize: bool,
                 shared_intermediate_size: int | None = None, float32_weights: bool = False,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.top_k, self.normalize, self.float32_weights = top_k, normalize, float32_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, tp=tp)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_top_k(self.gate(x), self.top_k, self.normalize)
        out = self.experts(x, weights if self.float32_weights else weights.to(x.dtype), ids)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
