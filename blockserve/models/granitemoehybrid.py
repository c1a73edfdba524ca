"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers interleaved with attention layers.

`config.layer_types` says which mixer each layer has ("linear_attention" is Mamba2); every
layer then runs a shared SwiGLU MLP, plus a top-k MoE where `num_local_experts > 0`. Granite's
muP multipliers scale the embeddings, each residual branch, the attention scores and the logits.

    x ─► embed * m_emb ─► [x += m_res mixer(norm x); x += m_res ffn(norm x)] × L ─► norm ─► lm_head / m_logits

    mamba        gate | xBC | dt = in_proj(x); xBC ─► conv ─► SSD scan (state slot);
                 out_proj(grouped_rmsnorm(y * silu(gate)))
    attention    q, k, v; RoPE only if position_embedding_type == "rope" (Granite 4.0-H uses none);
                 scale = attention_multiplier
    ffn          shared_mlp(x) (+ experts: softmax over the top-k router logits, SwiGLU)

KV: attention layers hold K/V blocks (FullAttentionSpec); Mamba2 layers hold one state slot per
request (LinearStateSpec: conv state, SSM state), zeroed for a new request because the spec
says so (C1).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.mamba2 import Mamba2
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv import FullAttentionSpec, LinearStateSpec
from blockserve.models.experts import Experts
from blockserve.models.llama import RMSNorm, RotaryEmbedding, apply_rotary

# Granite's checkpoint names -> the names transformers (and this file) use for the MoE weights.
_RENAMES = {
    "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
}


class GatedGroupRMSNorm(nn.Module):
    """(y * silu(gate)), RMS-normalised within each of `groups` equal slices, times weight."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = (y * F.silu(gate)).unflatten(-1, (self.groups, -1))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.flatten(-2)


class GraniteMambaLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        heads, head_dim = config.mamba_n_heads, config.mamba_d_head
        self.ssm = Mamba2(f"model.layers.{layer_idx}.mamba", heads, head_dim, config.mamba_n_groups,
                          config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size,
                          config.time_step_limit or (0.0, float("inf")))
        self.intermediate_size, conv_dim = heads * head_dim, self.ssm.conv_dim
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate_size + conv_dim + heads,
                                 bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.mamba_d_conv, groups=conv_dim, bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GatedGroupRMSNorm(self.intermediate_size, config.mamba_n_groups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mamba_proj_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, xBC, dt = self.in_proj(x).split([self.intermediate_size, self.ssm.conv_dim, self.ssm.num_heads], dim=-1)
        y = self.ssm(xBC, dt, self.conv1d.weight[:, 0], self.conv1d.bias, -self.A_log.float().exp(), self.D,
                     self.dt_bias, ctx)
        return self.out_proj(self.norm(y, gate))


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=bias)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend_cls(config.attention_multiplier))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, self.v_proj(x), ctx))


class SharedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # gate | up
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, index = self.router(x).float().topk(self.top_k, dim=-1)
        return self.experts(x, index, top_logits.softmax(-1).to(x.dtype))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.mamba = GraniteMambaLayer(config, layer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = GraniteAttention(config, layer_idx, head_dim, backend_cls)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r} "
                             "(expected 'linear_attention' (Mamba2) or 'full_attention')")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = MoE(config) if config.num_local_experts > 0 else None
        self.shared_mlp = SharedMLP(config.hidden_size, config.shared_intermediate_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, rope, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx) if self.layer_type == "linear_attention" else self.self_attn(h, rope, ctx)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = ffn + self.block_sparse_moe(h)
        return x + ffn * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.rotary = RotaryEmbedding(config, head_dim) if config.position_embedding_type == "rope" else None
        self.embedding_multiplier = config.embedding_multiplier
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(GraniteDecoderLayer(config, i, head_dim, backend_cls)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = self.rotary(positions) if self.rotary is not None else None
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)


class GraniteMoeHybridForCausalLM(nn.Module):
    """`GraniteMoeHybridForCausalLM(hf_config, attention_backend_cls)`; call `load_weights` before use."""

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported by Granite 4.0-H "
                             "(expected 'silu')")
        self.config = hf_config
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = GraniteMoeHybridModel(hf_config, self.head_dim, attention_backend_cls)
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] of the flattened batch -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float() / self.config.logits_scaling

    def kv_cache_specs(self, block_size: int) -> dict[str, FullAttentionSpec | LinearStateSpec]:
        specs: dict[str, FullAttentionSpec | LinearStateSpec] = {}
        for i, layer in enumerate(self.model.layers):
            if layer.layer_type == "full_attention":
                specs[f"model.layers.{i}.self_attn"] = FullAttentionSpec(
                    block_size, self.config.num_key_value_heads, self.head_dim, "float32")
            else:
                shapes = layer.mamba.ssm.state_shapes
                specs[f"model.layers.{i}.mamba"] = LinearStateSpec(shapes, ("float32",) * len(shapes))
        return specs

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Materialise every parameter from (Hugging Face name, tensor) pairs, as float32.

        The MoE weights may come under Granite's checkpoint names (`block_sparse_moe.input_linear`,
        `output_linear`, `router.layer`) or transformers' (`experts.gate_up_proj`, ...). Raises
        ValueError naming unexpected, missing or mis-shaped weights.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target = name
            for old, new in _RENAMES.items():
                if name.endswith(old):
                    target = name[: -len(old)] + new
            if target not in params:
                unexpected.append(name)
                continue
            if tensor.shape != params[target].shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)} but the model built from the config "
                                 f"expects {tuple(params[target].shape)}; does config.json match the checkpoint?")
            module_path, _, leaf = target.rpartition(".")
            weight = nn.Parameter(tensor.detach().to(torch.float32).contiguous(), requires_grad=False)
            setattr(self.get_submodule(module_path), leaf, weight)
            loaded.add(target)
        missing = [n for n in params if n not in loaded]
        if unexpected or missing:
            raise ValueError(
                f"checkpoint does not match the {type(self).__name__} built from its config: "
                f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, "
                f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
