"""Gated DeltaNet (Qwen3-Next's linear attention) over each request's state slot.

A slot holds two states per layer, both zero for a new request (C1: its LinearStateSpec
says so, so the engine zeroes new slots; this kernel declares reads_unwritten_slots = False):

    conv state       [conv_dim, K - 1]        the last K - 1 inputs of the short causal conv
    recurrent state  [Hv, Dk, Dv]             S, the delta-rule memory

Per token, after the depthwise causal conv + SiLU over the (q | k | v) channels, with q and k
L2-normalised, q scaled by Dk^-1/2 and q/k heads repeated to the Hv value heads:

    S   = exp(g_t) S                          gated decay (g_t <= 0)
    S  += k_t (beta_t (v_t - S^T k_t))^T      delta rule: write only the correction
    o_t = S^T q_t

Decodes (one query token) run the single step above, batched (`attention/state_decodes.py`: on the
CPU one native call over all decode rows, `native/csrc/state_recurrence.cpp`). Prefill chunks run the chunked
form (the UT transform of the DeltaNet paper, as transformers' torch fallback computes it),
one sequence at a time, starting from the state in the slot: zero for a fresh prompt, the
previous chunk's state for a continuing one. Both write their final states back to the slot.
The chunks end on multiples of `chunk_size` in absolute position (a continuing prefill's first
chunk is short), so a state saved at such a position resumes exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.chunk_grid import capture_targets, check_captures
from blockserve.attention.context import ForwardContext
from blockserve.attention.pointwise import silu
from blockserve.attention.state_decodes import StateDecode, run_decodes
from blockserve.kv.specs import LinearStateSpec
from blockserve.native.extension import state_recurrence_ops


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (as the FLA library and transformers)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  start: int = 0, capture: list[int] | None = None):
    """Depthwise causal conv of one sequence continuing from `state`, before the activation.

    x [L, C], state [C, K - 1] (the K - 1 inputs before x), weight [C, K] -> (y [L, C], new state).
    x sits at absolute positions [start, start + L); with `capture` (positions in
    (start, start + L]) the result also holds the conv state before each p in capture, exactly.
    A sum of K shifted products rather than F.conv1d, whose depthwise CPU kernel can cost tens of
    milliseconds per call when its threads contend.
    """
    length, width = x.shape[0], weight.shape[1]
    window = torch.cat([state.T, x])  # [K - 1 + L, C], from position start - K + 1
    y = window[:length] * weight[:, 0]
    for i in range(1, width):
        y = y + window[i:i + length] * weight[:, i]
    if bias is not None:
        y = y + bias
    if capture is None:
        return y, window[length:].T
    check_captures(capture, start, length)
    return y, window[length:].T, [window[p - start:p - start + width - 1].T for p in capture]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One step for a batch: q, k [B, H, Dk] (normalised, q scaled), v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] -> (o [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # S^T k  [B, H, Dv]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64, start: int = 0,
                           capture: list[int] | None = None):
    """The same recurrence over one sequence, `chunk_size` tokens per matmul.

    q, k [L, H, Dk] (normalised, q scaled), v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv]
    -> (o [L, H, Dv], final state). The tokens sit at absolute positions [start, start + L) and
    chunks end on multiples of `chunk_size` (the first padded in front when `start` is not
    one), so resuming at such a multiple from the state there computes exactly what running
    through it computes. Padding uses g = beta = k = 0: no effect. With `capture` (multiples of
    `chunk_size` in (start, start + L]) the result is (o, final state, [the state after the
    tokens before p, for each p in capture]), taken at chunk ends.
    """
    length, heads = q.shape[:2]
    check_captures(capture, start, length, chunk_size)
    front = start % chunk_size
    pad = (-start - length) % chunk_size
    # Contiguous whether padded or not: a matmul's rounding can depend on its operands' layout.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, front, pad)).unflatten(1, (-1, chunk_size)).contiguous()
               for x in (q, k, v))
    g, beta = (F.pad(x.T, (front, pad)).unflatten(1, (-1, chunk_size)) for x in (g, beta))  # [H, N, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # [H, N, C, C]
    # UT transform: (I + strictly_lower(beta_i k_i.k_j decay_ij)) [u | w] = [beta v | beta k exp(cum)]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out, taken = torch.empty_like(v), {}
    state = state.to(v.dtype)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
        if capture and (end := start - front + (i + 1) * chunk_size) in capture:
            taken[end] = state
    out = out.flatten(1, 2)[:, front:front + length].transpose(0, 1)
    return (out, state) if capture is None else (out, state, [taken[p] for p in capture])


class GatedDeltaNet(nn.Module):
    """Conv + gated delta rule over the state slots of layer `layer_name`; owns no weights.

    forward(mixed_qkv [T, conv_dim] in (q | k | v) channel order, g [T, Hv], beta [T, Hv],
            conv_weight [conv_dim, K], conv_bias [conv_dim] or None, ctx) -> o [T, Hv, Dv]

    `chunk_size`: prefill chunks end at absolute positions that are multiples of it, where a
    saved state resumes exactly.
    """

    reads_unwritten_slots = False  # C1: a new slot's state is zeroed because its spec demands it

    def __init__(self, layer_name: str, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int, chunk_size: int = 64, *, dtype: torch.dtype):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        if conv_kernel_size < 2:
            raise ValueError(f"the conv kernel must be at least 2 wide, got {conv_kernel_size}")
        self.layer_name = layer_name
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.dtype = dtype  # the model's (states are float32)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one slot."""
        return (self.conv_dim, self.conv_kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def kv_cache_spec(self, block_size: int) -> LinearStateSpec:
        """One state slot per request, whatever `block_size`."""
        return LinearStateSpec(self.state_shapes, ("float32",) * 2, chunk_size=self.chunk_size)

    def _qkv(self, mixed: torch.Tensor):
        """Conv output [..., conv_dim] -> q, k [..., Hv, Dk] (normalised, q scaled), v [..., Hv, Dv]."""
        q, k, v = silu(mixed).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = l2norm(q.unflatten(-1, (self.num_k_heads, self.head_k_dim))).repeat_interleave(rep, dim=-2)
        k = l2norm(k.unflatten(-1, (self.num_k_heads, self.head_k_dim))).repeat_interleave(rep, dim=-2)
        return q * self.head_k_dim**-0.5, k, v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                conv_bias: torch.Tensor | None, ctx: ForwardContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_name)
        conv_states, rec_states = cache.tensors
        layout = meta.layout
        dtype = mixed_qkv.dtype  # the recurrence runs in float32, as its states are stored
        mixed_qkv, g, beta, conv_weight = (t.float() for t in (mixed_qkv, g, beta, conv_weight))
        conv_bias = None if conv_bias is None else conv_bias.float()
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], self.num_v_heads, self.head_v_dim)
        nd = layout.num_decodes
        if nd:
            def features(mixed, rows):
                return *self._qkv(mixed), g[rows], beta[rows]

            native = state_recurrence_ops() if out.device.type == "cpu" else None
            run_decodes(self.layer_name, meta, (conv_states, rec_states), out,
                        StateDecode(mixed_qkv, conv_weight, conv_bias, features, recurrent_gated_delta_rule,
                                    None if native is None else native.delta_rule_rows))
        for i in range(nd, layout.num_seqs):
            start, end = layout.query_start[i], layout.query_start[i + 1]
            s, first = meta.slot_ids[i], layout.seq_lens[i] - (end - start)
            positions, targets = capture_targets(meta.captures.get(i))
            mixed, conv_states[s], *conv_caps = causal_conv1d(mixed_qkv[start:end], conv_states[s], conv_weight,
                                                              conv_bias, first, positions)
            q, k, v = self._qkv(mixed)
            out[start:end], rec_states[s], *rec_caps = chunk_gated_delta_rule(
                q, k, v, g[start:end], beta[start:end], rec_states[s], self.chunk_size, first, positions)
            if positions:
                conv_states[targets], rec_states[targets] = torch.stack(conv_caps[0]), torch.stack(rec_caps[0])
        return out.to(dtype)
