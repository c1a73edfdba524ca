"""Mamba2 (SSD) over each request's state slot.

A slot holds two states per layer, both zero for a new request (C1: its LinearStateSpec
says so, so the engine zeroes new slots; this kernel declares reads_unwritten_slots = False):

    conv state   [conv_dim, K - 1]     the last K - 1 inputs of the short causal conv
    SSM state    [H, P, N]             h, per head: head_dim x state_size

The conv (+ SiLU) runs over the (x | B | C) channels; x has H heads of P, B and C have G
groups of N, each group serving H / G consecutive heads. Per token, with dt = softplus(dt_raw +
dt_bias) and A = -exp(A_log) < 0:

    h   = exp(dt A) h + dt x B^T        decay, then write      [H, P, N]
    y   = h C + D x                     read, plus the skip     [H, P]

Decodes (one query token) run that step, batched (`attention/state_decodes.py`: on the CPU one
native call over all decode rows, `native/csrc/state_recurrence.cpp`). Prefill chunks run the chunked SSD scan
(as transformers' torch fallback computes it: quadratic within a chunk, a recurrence over
chunk states between them), one sequence at a time, from the state in the slot. The chunks
end on multiples of `chunk_size` in absolute position (a continuing prefill's first chunk is
short), so a state saved at such a position resumes exactly.
The chunked path clamps dt to `dt_limit` and the single step does not, as in transformers and
mamba_ssm; with the default limit (0, inf) the clamp does nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.chunk_grid import capture_targets, check_captures
from blockserve.attention.context import ForwardContext
from blockserve.attention.gated_deltanet import causal_conv1d
from blockserve.attention.pointwise import silu, softplus
from blockserve.attention.state_decodes import StateDecode, run_decodes
from blockserve.kv.specs import LinearStateSpec
from blockserve.native.extension import state_recurrence_ops


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> [..., C, C]: out[i, j] = x[j+1] + ... + x[i] for j <= i, -inf above (stable form)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)  # [..., i(row), j]: x[..., i] at every column j
    ones = torch.ones(size, size, dtype=torch.bool, device=x.device)
    sums = x.masked_fill(~ones.tril(-1), 0).cumsum(-2)  # row i, column j: x[j+1] + ... + x[i]
    return sums.masked_fill(~ones.tril(0), float("-inf"))


def ssd_step(x, dt, A, B, C, D, state):
    """One step for a batch: x [B, H, P], dt [B, H] (after softplus), A, D [H], B, C [B, H, N]
    (already per head), state [B, H, P, N] -> (y [B, H, P], new state)."""
    state = state * (dt * A).exp()[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return (state @ C[..., None])[..., 0] + D[:, None] * x, state


def ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size: int, start: int = 0, capture: list[int] | None = None):
    """The same recurrence over one sequence, `chunk_size` tokens per block of matmuls.

    x [L, H, P], dt [L, H] (after softplus and clamp), A, D [H], B, C [L, H, N] (per head),
    state [H, P, N] -> (y [L, H, P], final state). The tokens sit at absolute positions
    [start, start + L) and chunks end on multiples of `chunk_size` (the first padded in front
    when `start` is not one), so resuming at such a multiple from the state there computes
    exactly what running through it computes. Padding uses dt = 0 (decay 1, no write). With
    `capture` (multiples of `chunk_size` in (start, start + L]) the result is (y, final state,
    [the state after the tokens before p, for each p in capture]), taken at chunk ends.
    """
    length = x.shape[0]
    check_captures(capture, start, length, chunk_size)
    front = start % chunk_size
    pad = (-start - length) % chunk_size
    skip = D[:, None] * x
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, front, pad)).unflatten(0, (-1, chunk_size))  # [N, C, H, P]
    B, C = (F.pad(t, (0, 0, 0, 0, front, pad)).unflatten(0, (-1, chunk_size)) for t in (B, C))  # [N, C, H, N]
    a = F.pad(dt * A, (0, 0, front, pad)).unflatten(0, (-1, chunk_size)).permute(2, 0, 1)  # [H, N, C]
    a_cum = a.cumsum(-1)

    # Within each chunk: y_l += sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s
    decay = segment_sum(a).exp()  # [H, N, l, s]
    # C B^T on contiguous [H, chunks, C, N] operands: unlike einsum's layout, its rounding does not
    # change with the number of chunks (so resuming on the grid stays exact).
    Ch, Bh = (t.permute(2, 0, 1, 3).contiguous() for t in (C, B))
    scores = (Ch @ Bh.transpose(-1, -2)) * decay  # [H, chunks, l, s]
    y = torch.einsum("hcls,cshp->clhp", scores, xdt)

    # Each chunk's own contribution to the state at its end, then the recurrence over chunks.
    to_end = (a_cum[..., -1:] - a_cum).exp()  # [H, N, C]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, xdt)
    chunk_decay = a_cum[..., -1].exp()  # [H, N]
    starts, taken = [], {}
    state = state.to(x.dtype)
    for i in range(xdt.shape[0]):
        starts.append(state)
        state = state * chunk_decay[:, i, None, None] + chunk_states[i]
        if capture and (end := start - front + (i + 1) * chunk_size) in capture:
            taken[end] = state
    # Plus what each chunk reads of the state it starts from.
    y = y + torch.einsum("clhn,chpn,hcl->clhp", C, torch.stack(starts), a_cum.exp())
    y = y.flatten(0, 1)[front:front + length] + skip
    return (y, state) if capture is None else (y, state, [taken[p] for p in capture])


class Mamba2(nn.Module):
    """Conv + SSD scan over the state slots of layer `layer_name`; owns no weights.

    forward(xBC [T, conv_dim] in (x | B | C) channel order, dt [T, H] (raw, before bias and
            softplus), conv_weight [conv_dim, K], conv_bias or None, A [H] (negative), D [H],
            dt_bias [H], ctx) -> y [T, H * P] (before the gated norm)

    `chunk_size`: prefill chunks end at absolute positions that are multiples of it, where a
    saved state resumes exactly.
    """

    reads_unwritten_slots = False  # C1: a new slot's state is zeroed because its spec demands it

    def __init__(self, layer_name: str, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel_size: int, chunk_size: int, dt_limit: tuple[float, float] = (0.0, float("inf")), *,
                 dtype: torch.dtype):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_n_heads ({num_heads}) must be a multiple of mamba_n_groups ({n_groups})")
        if conv_kernel_size < 2:
            raise ValueError(f"the conv kernel must be at least 2 wide, got {conv_kernel_size}")
        self.layer_name = layer_name
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.dt_limit = tuple(dt_limit)
        self.dtype = dtype  # the model's (states are float32)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) of one slot."""
        return (self.conv_dim, self.conv_kernel_size - 1), (self.num_heads, self.head_dim, self.state_size)

    def kv_cache_spec(self, block_size: int) -> LinearStateSpec:
        """One state slot per request, whatever `block_size`."""
        return LinearStateSpec(self.state_shapes, ("float32",) * 2, chunk_size=self.chunk_size)

    def _split(self, xBC: torch.Tensor):
        """Conv output [..., conv_dim] -> x [..., H, P], B, C [..., H, N] (groups repeated to heads)."""
        gn = self.n_groups * self.state_size
        x, B, C = silu(xBC).split([self.intermediate_size, gn, gn], dim=-1)
        rep = self.num_heads // self.n_groups
        B, C = (t.unflatten(-1, (self.n_groups, self.state_size)).repeat_interleave(rep, dim=-2) for t in (B, C))
        return x.unflatten(-1, (self.num_heads, self.head_dim)), B, C

    def forward(self, xBC: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_name)
        conv_states, ssm_states = cache.tensors
        layout = meta.layout
        dtype = xBC.dtype  # the recurrence runs in float32, as its states are stored
        xBC, dt, conv_weight, A, D, dt_bias = (t.float() for t in (xBC, dt, conv_weight, A, D, dt_bias))
        conv_bias = None if conv_bias is None else conv_bias.float()
        dt = softplus(dt + dt_bias)
        out = xBC.new_empty(xBC.shape[0], self.num_heads, self.head_dim)
        nd = layout.num_decodes
        if nd:
            def features(mixed, rows):
                x, B, C = self._split(mixed)
                return x, dt[rows], B, C

            def recur(x, dt_rows, B, C, state):
                return ssd_step(x, dt_rows, A, B, C, D, state)

            def rows(x, dt_rows, B, C, *table_source_out_after):
                native.ssd_rows(x, dt_rows, A, B, C, D, *table_source_out_after)

            native = state_recurrence_ops() if out.device.type == "cpu" else None
            run_decodes(self.layer_name, meta, (conv_states, ssm_states), out,
                        StateDecode(xBC, conv_weight, conv_bias, features, recur, None if native is None else rows))
        dt = dt.clamp(*self.dt_limit)
        for i in range(nd, layout.num_seqs):
            start, end = layout.query_start[i], layout.query_start[i + 1]
            s, first = meta.slot_ids[i], layout.seq_lens[i] - (end - start)
            positions, targets = capture_targets(meta.captures.get(i))
            mixed, conv_states[s], *conv_caps = causal_conv1d(xBC[start:end], conv_states[s], conv_weight, conv_bias,
                                                              first, positions)
            x, B, C = self._split(mixed)
            out[start:end], ssm_states[s], *ssm_caps = ssd_chunk_scan(
                x, dt[start:end], A, B, C, D, ssm_states[s], self.chunk_size, first, positions)
            if positions:
                conv_states[targets], ssm_states[targets] = torch.stack(conv_caps[0]), torch.stack(ssm_caps[0])
        return out.flatten(1).to(dtype)
