"""Rotary position embeddings: a config's RoPE frequencies, the cos/sin table, and the two layouts
they are applied in.

    rotate_half   (x[:D/2], x[D/2:]) rotated together      Llama, Qwen, Gemma 3, Granite, DeepSeek-V3
    interleaved   pairs (x0, x1), (x2, x3), ... rotated     DeepSeek-V3 with rope_interleave, GLM-4

Frequencies and angles are computed in float32 whatever the model's dtype (as transformers does);
the table is stored in the placement's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from blockserve.models.placement import Placement


def inverse_frequencies(config, params: dict, head_dim: int, device: torch.device,
                        **kwargs) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) of RoPE parameters `params` (the config's
    rope_parameters, or one layer type's), by transformers' own functions so every scaling type
    it knows applies; `kwargs` go to them. A config's `rope_freq_divisors` (a GGUF's rope_freqs
    tensor: llama.cpp's per-dimension divisors) divide the frequencies after. ValueError for an
    unknown type, a partial rotary dim, or divisors of another length."""
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":  # imported only here: a default-RoPE model never imports transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type == "default":  # as transformers' compute_default_rope_parameters
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=device, **kwargs)
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}; "
                         f"transformers knows: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if 2 * inv_freq.numel() != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported "
                         f"(rotary dim {2 * inv_freq.numel()}, head_dim {head_dim})")
    divisors = getattr(config, "rope_freq_divisors", None)
    if divisors is not None:
        if len(divisors) != inv_freq.numel():
            raise ValueError(f"rope_freq_divisors has {len(divisors)} entries for {inv_freq.numel()} rotary "
                             "frequencies; the GGUF's rope_freqs does not match the model: convert it again")
        inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32, device=device)
    return inv_freq, scaling


class RotaryEmbedding(nn.Module):
    """cos/sin of every position below max_position_embeddings, computed once at construction.

    "dynamic" equals the default inside the trained length, which is as far as the table goes;
    "longrope" uses its short factors below original_max_position_embeddings, long ones from there.
    """

    def __init__(self, config, head_dim: int, placement: Placement):
        super().__init__()
        params = config.rope_parameters
        device = placement.device
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)[:, None]
        inv_freq, scaling = inverse_frequencies(config, params, head_dim, device)
        freqs = positions * inv_freq
        if params.get("rope_type") == "longrope":
            original = params["original_max_position_embeddings"]
            long_inv_freq, _ = inverse_frequencies(config, params, head_dim, device, seq_len=original + 1)
            freqs = torch.where(positions < original, freqs, positions * long_inv_freq)
        self.register_buffer("cos", (freqs.cos() * scaling).to(placement.dtype), persistent=False)  # [P, D/2]
        self.register_buffer("sin", (freqs.sin() * scaling).to(placement.dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the tokens at `positions` (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of x [T, H, D] (Hugging Face's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (x0, x1), (x2, x3), ... of x [T, H, D]; the result is laid out as rotate_half's
    halves (as transformers' apply_rotary_pos_emb_interleave), the same for q and k."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
