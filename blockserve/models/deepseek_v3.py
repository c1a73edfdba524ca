"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) over the paged latent cache: MLA, dense first layers, MoE.

    x ─► embed ─► [ x += o(mla(norm x))   x += ffn(norm x) ] × L ─► norm ─► lm_head
                                               │
             layer < first_k_dense_replace: dense SwiGLU MLP
             otherwise: MoE = shared experts(x) + Σ_top-k  weight_e · expert_e(x)

MLA (multi-head latent attention, attention/mla.py) caches one latent row per token: the
normalised `kv_lora_rank` compression and the shared rope key. Queries come from `q_proj`, or
from the low-rank `q_a_proj ─► q_a_layernorm ─► q_b_proj` when `q_lora_rank` is set; each head's
last `qk_rope_head_dim` dims carry RoPE (interleaved pairs when `rope_interleave`, as the
checkpoints are laid out). The softmax scale is qk_head_dim^-0.5, times mscale^2 under YaRN.

Routing, exactly as the config asks (and as transformers' DeepseekV3TopkRouter):

    scores = sigmoid(gate(x))                       fp32, [T, E]
    choice = scores + e_score_correction_bias       used to pick experts, never as weights
    groups: E split into n_group; a group's score = sum of its top-2 choices; keep topk_group
    experts: the top num_experts_per_tok choices within the kept groups
    weights = their scores, / their sum if norm_topk_prob, × routed_scaling_factor

The MLA block, the MoE and the checkpoint loader are shared with Kimi Linear (kimi_linear.py).
Not supported: DeepSeek-V3's fp8 checkpoints (`weight_scale_inv`) — dequantise to bf16/fp32
first — and its multi-token-prediction layer, whose weights (layers past num_hidden_layers) are
ignored as transformers ignores them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.mla import MLA_BACKENDS, MLAttention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv import MLASpec
from blockserve.models.llama import RMSNorm, RotaryEmbedding, apply_rotary


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (x0, x1), (x2, x3), ... of x [T, H, D]; the result is laid out as rotate_half's
    halves (as transformers' apply_rotary_pos_emb_interleave), the same for q and k."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def yarn_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's convention)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def mla_backend_for(attention_backend_cls: type[PagedAttention]):
    """The MLA flavour (exact / whole_block) named like the engine's attention backend."""
    return MLA_BACKENDS[attention_backend_cls.name]


class MLABlock(nn.Module):
    """Projections around the paged MLA layer. `use_rope=False` (Kimi Linear): no position
    encoding at all, the rope part of keys and queries is used as is."""

    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention], use_rope: bool,
                 scale: float):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.use_rope = use_rope
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' default eps, not the config's
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.kv_b_proj.keep_row_major = True  # MLAttention views its weight per head
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.attn = MLAttention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.qk_nope_head_dim,
                                self.v_head_dim, mla_backend_for(attention_backend_cls)(scale))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.use_rope:
            rotate = apply_rotary_interleaved if self.rope_interleave else apply_rotary
            q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            q = torch.cat([q_nope, rotate(q_rope, cos, sin)], dim=-1)
            k_rope = rotate(k_rope[:, None], cos, sin)[:, 0]
        return self.o_proj(self.attn(q, latent, k_rope, self.kv_b_proj.weight, ctx))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
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


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w13 [E, 2I, hidden] (gate; up), w2 [E, hidden, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # only the experts some token picked, in id order
            tokens, slot = torch.where(ids == e)
            gate, up = F.linear(x[tokens], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def from_checkpoint(self, prefix: str, leaf: str, take: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Per-expert checkpoint weights `{prefix}.{e}.{gate,up,down}_proj.weight`, stacked."""
        if leaf == "w13":
            return torch.stack([torch.cat([take(f"{prefix}.{e}.gate_proj.weight"),
                                           take(f"{prefix}.{e}.up_proj.weight")])
                                for e in range(self.num_experts)])
        return torch.stack([take(f"{prefix}.{e}.down_proj.weight") for e in range(self.num_experts)])


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLABlock(config, layer_idx, attention_backend_cls, use_rope=True,
                                  scale=yarn_softmax_scale(config))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = layer_idx < config.first_k_dense_replace
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim)  # computed here, not loaded
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, attention_backend_cls)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """`DeepseekV3ForCausalLM(hf_config, attention_backend_cls)`; call `load_weights` before use.
    The attention backend's name picks the MLA flavour (exact / whole_block)."""

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (expected 'silu')")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DeepseekV3Model(hf_config, attention_backend_cls)
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] of the flattened batch -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def kv_cache_specs(self, block_size: int) -> dict[str, MLASpec]:
        spec = MLASpec(block_size, self.config.kv_lora_rank, self.config.qk_rope_head_dim, "float32")
        return {f"model.layers.{i}.self_attn": spec for i in range(self.config.num_hidden_layers)}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names, per-expert weights stacked; see `load_checkpoint`."""
        load_checkpoint(self, named_tensors, lambda name: name, self.config.num_hidden_layers)


def load_checkpoint(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    rename: Callable[[str], str | None], num_layers: int) -> None:
    """Materialise every parameter of `model` (built on the meta device) as float32 from
    (checkpoint name, tensor) pairs. `rename` maps a checkpoint name to ours (None: skip it).
    A module with `from_checkpoint(prefix, leaf, take)` composes its parameters from several
    tensors; the others take the tensor of their own name. Raises ValueError naming unexpected,
    missing or mis-shaped weights. Weights of layers past `num_layers` (DeepSeek's MTP) and
    rotary tables are ignored."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        ours = rename(name)
        if ours is None or ours.endswith("rotary_emb.inv_freq"):
            continue
        parts = ours.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            continue
        tensors[ours] = tensor
    if getattr(model, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    used: set[str] = set()
    missing: list[str] = []

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            missing.append(name)
            raise KeyError(name)
        used.add(name)
        return tensors[name]

    for target, param in list(model.named_parameters()):
        module_path, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_path)
        try:
            if hasattr(module, "from_checkpoint"):
                tensor = module.from_checkpoint(module_path, leaf, take)
            else:
                tensor = take(target)
        except KeyError:
            continue
        if tensor.shape != param.shape:
            raise ValueError(f"weight for {target} has shape {tuple(tensor.shape)} but the model built from the "
                             f"config expects {tuple(param.shape)}; does config.json match the checkpoint?")
        setattr(module, leaf, nn.Parameter(tensor.detach().to(torch.float32).contiguous(), requires_grad=False))
    unexpected = sorted(set(tensors) - used)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the {type(model).__name__} built from its config: "
            f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, "
            f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
