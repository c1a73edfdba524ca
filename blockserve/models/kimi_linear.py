"""Kimi Linear (`KimiLinearForCausalLM`): MLA full-attention layers interleaved with Kimi Delta
Attention (KDA) layers, MoE feed-forward. Reference: transformers 5.24's kimi_linear model.

    x ─► embed ─► [ x += mixer(norm x)   x += ffn(norm x) ] × L ─► norm ─► lm_head

    layer_types[i]      "full_attention": MLA without position encoding (NoPE; the rope part of
                        keys and queries is used unrotated), latent rows in an MLASpec group
                        "linear_attention": KDA, conv + recurrent state in a LinearStateSpec slot
    mlp_layer_types[i]  "dense": SwiGLU MLP; "sparse": DeepSeek-V3's MoE (sigmoid, grouped top-k)

KDA layer (attention/kda.py does the conv, the delta rule and the state slot):

    q, k, v = q_proj x, k_proj x, v_proj x  ─► short causal conv + SiLU (in the state layer)
    g    = -exp(A_log) * softplus(f_b(f_a x) + dt_bias)      per head and channel, [T, H, D]
    beta = sigmoid(b_proj x)                                 per head
    out  = o_proj( rmsnorm(kda(q, k, v, g, beta)) * o_norm.weight * sigmoid(g_b(g_a x)) )

Checkpoints: the names moonshotai/Kimi-Linear publishes (and save_pretrained writes):
`block_sparse_moe.` for the feed-forward, experts `w1` (gate) `w3` (up) `w2` (down), separate
`q_conv1d` / `k_conv1d` / `v_conv1d`, `f_a_proj` / `f_b_proj` / `dt_bias` / `A_log` under
`self_attn`. transformers' runtime names (`mlp.`, `forget_gate.`) are accepted too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.kda import KimiDeltaAttention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv import LinearStateSpec, MLASpec
from blockserve.models.deepseek_v3 import MLP, MLABlock, MoE, load_checkpoint
from blockserve.models.llama import RMSNorm


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * sigmoid(gate), over the last dim (fla's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * gate.sigmoid()


class KDABlock(nn.Module):
    """Projections, gates and output norm around the KDA state layer."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = h = config.linear_num_heads
        self.head_dim = d = config.linear_head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, h * d, bias=False)
        self.v_proj = nn.Linear(hidden, h * d, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * h * d, config.linear_conv_kernel_dim))  # [q | k | v] channels
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(h * d))
        self.A_log = nn.Parameter(torch.empty(1, 1, h, 1))
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, h * d, bias=False)
        self.o_norm = GatedRMSNorm(d, config.rms_norm_eps)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.attn = KimiDeltaAttention(f"model.layers.{layer_idx}.self_attn", h, d, config.linear_conv_kernel_dim)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = (self.f_b_proj(self.f_a_proj(x)) + self.dt_bias).view(t, h, d)
        g = -self.A_log.view(h, 1).exp() * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))  # as transformers
        beta = self.b_proj(x).sigmoid()
        o = self.attn(mixed, self.conv_weight, g, beta, ctx)  # [T, H, D]
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        return self.o_proj(self.o_norm(o, gate).reshape(t, h * d))

    def from_checkpoint(self, prefix: str, leaf: str, take: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if leaf == "conv_weight":  # three depthwise convs [C, 1, K] -> one [3C, K]
            return torch.cat([take(f"{prefix}.{p}_conv1d.weight")[:, 0] for p in "qkv"])
        return take(f"{prefix}.{leaf}")


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        self.linear = config.layer_types[layer_idx] == "linear_attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.linear:
            self.self_attn = KDABlock(config, layer_idx)
        else:
            scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
            self.self_attn = MLABlock(config, layer_idx, attention_backend_cls, use_rope=False, scale=scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = MoE(config) if sparse else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, ctx) if self.linear else self.self_attn(h, None, None, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearModel(nn.Module):
    def __init__(self, config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, i, attention_backend_cls)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


_RENAMES = [  # published / saved checkpoint names -> ours (transformers' runtime names)
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
]


def _rename(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


class KimiLinearForCausalLM(nn.Module):
    """`KimiLinearForCausalLM(hf_config, attention_backend_cls)`; call `load_weights` before use.
    The attention backend's name picks the MLA flavour (exact / whole_block)."""

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (expected 'silu')")
        unknown = set(hf_config.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"unknown Kimi Linear layer types {sorted(unknown)}; "
                             "expected 'full_attention' (MLA) or 'linear_attention' (KDA) per layer")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = KimiLinearModel(hf_config, attention_backend_cls)
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] of the flattened batch -> final hidden states [T, hidden_size].
        No layer uses positions: MLA here is NoPE and KDA is recurrent."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def kv_cache_specs(self, block_size: int) -> dict[str, MLASpec | LinearStateSpec]:
        """MLASpec for the MLA layers; the KDA layers' conv + recurrent state shapes for the others."""
        mla = MLASpec(block_size, self.config.kv_lora_rank, self.config.qk_rope_head_dim, "float32")
        return {f"model.layers.{i}.self_attn": layer.self_attn.attn.state_spec() if layer.linear else mla
                for i, layer in enumerate(self.model.layers)}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, named_tensors, _rename, self.config.num_hidden_layers)
