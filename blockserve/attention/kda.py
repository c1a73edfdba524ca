"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, after a short
causal convolution, with its conv and recurrent states in the request's linear-state slot.

Reference semantics: transformers 5.24 `models/kimi_linear/modeling_kimi_linear.py`
(`KimiLinearDeltaAttention`, `recurrent_kimi_delta_attention`, `chunk_kimi_delta_attention`,
`causal_conv1d_fn` / `causal_conv1d_update`), itself the torch port of fla's `chunk_kda` /
`fused_recurrent_kda` used by moonshotai/Kimi-Linear-48B-A3B. Per head, with q and k
L2-normalised and q scaled by Dk^-0.5, a state S [Dk, Dv] evolves token by token:

    S <- diag(exp(g_t)) S                        g_t [Dk] <= 0: per-channel decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      the delta rule, beta_t in (0, 1)
    o_t = S^T q_t

    recurrent form   the loop above; decode runs one step for all decoding sequences at once
                     (`attention/state_decodes.py`; on the CPU one native call,
                     `native/csrc/state_recurrence.cpp`)
    chunked form     the same function, C tokens at a time (prefill): within a chunk the
                     delta-rule corrections are one unit-lower-triangular solve, and the state
                     is carried across chunks (see `kda_chunked`); chunks end on multiples of
                     C in absolute position, so a state saved there can be resumed exactly

The short convolution is depthwise over the concatenated [q | k | v] projections, kernel K,
followed by SiLU. Its state is the last K - 1 inputs of the sequence (zero before the first).

    slot s of the layer's StateCache:  tensors[0][s] conv state [3 * H * D, K - 1]
                                       tensors[1][s] recurrent state [H, Dk, Dv]

A new request's slot is zero because the engine zeroed it (C1: the LinearStateSpec says its
state must start at zero), so the layer always starts from the slot and never re-zeroes: with
zeroing disabled a recycled slot's leftovers show, which is what the C1 tests check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.chunk_grid import capture_targets, check_captures
from blockserve.attention.context import ForwardContext, StateMetadata
from blockserve.attention.pointwise import silu
from blockserve.attention.state_decodes import StateDecode, run_decodes
from blockserve.kv.specs import LinearStateSpec
from blockserve.native.extension import state_recurrence_ops

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), as fla (not F.normalize's max(norm, eps))."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_step(q, k, v, g, beta, state):
    """One token for B sequences: q, k, g [B, H, Dk], v [B, H, Dv], beta [B, H], state
    [B, H, Dk, Dv] -> (o [B, H, Dv], new state). q, k normalised; q already scaled."""
    state = state * g.exp()[..., None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def kda_recurrent(q, k, v, g, beta, state):
    """One sequence token by token: q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H], state
    [H, Dk, Dv] -> (o [T, H, Dv], final state)."""
    out = []
    for t in range(q.shape[0]):
        o, state = kda_step(q[t], k[t], v[t], g[t], beta[t], state)
        out.append(o)
    return torch.stack(out), state


def kda_chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE, start: int = 0,
                capture: list[int] | None = None):
    """One sequence, `chunk_size` tokens at a time; same arguments and result as `kda_recurrent`.

    The tokens sit at absolute positions [start, start + T) and chunks end on multiples of
    `chunk_size` (the first is short when `start` is not one), so resuming at such a multiple
    from the state there computes exactly what running through it computes. With `capture`
    (multiples of `chunk_size` in (start, start + T]) the result is (o, final state, [the state
    after the tokens before p, for each p in capture]), taken at chunk ends.

    Within a chunk, with G the running sum of g from the chunk's start and
    D_ij = exp(G_i - G_j) (j <= i, per channel):

        L = strictly lower (beta_i k_i . D_ij k_j);  T = (I + L)^-1
        u = T (beta v);  w = T (beta k exp(G));  v' = u - w S
        o = (q exp(G)) S + tril(q_i . D_ij k_j) v'
        S <- exp(G_last) S + (k exp(G_last - G))^T v'
    """
    length = q.shape[0]
    check_captures(capture, start, length, chunk_size)
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, T, *]
    beta = beta.transpose(0, 1)
    out, taken = [], {}
    edges = [0, *range((-start) % chunk_size or chunk_size, length, chunk_size), length]
    for lo, hi in zip(edges, edges[1:]):
        sl = slice(lo, hi)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        G = g[:, sl].cumsum(dim=1)
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (G[:, :, None] - G[:, None]).masked_fill(~causal[..., None], float("-inf")).exp()  # [H, n, n, Dk]
        lower = ((bc * kc)[:, :, None] * kc[:, None] * decay).sum(-1).tril(-1)
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device).expand_as(lower)
        t = torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)
        u = t @ (bc * vc)
        w = t @ (bc * kc * G.exp())
        v_new = u - w @ state
        attn = (qc[:, :, None] * kc[:, None] * decay).sum(-1)  # zero above the diagonal
        out.append((qc * G.exp()) @ state + attn @ v_new)
        last = G[:, -1:]  # [H, 1, Dk]
        state = state * last.transpose(1, 2).exp() + (kc * (last - G).exp()).transpose(1, 2) @ v_new
        if capture and start + hi in capture:
            taken[start + hi] = state
    out = torch.cat(out, dim=1).transpose(0, 1)
    return (out, state) if capture is None else (out, state, [taken[p] for p in capture])


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, start: int = 0,
                capture: list[int] | None = None):
    """Depthwise causal conv of one sequence's new inputs x [n, C] after its conv state [C, K - 1]
    with weight [C, K] -> (outputs [n, C], new state), no activation. x sits at absolute positions
    [start, start + n); with `capture` (positions in (start, start + n]) the result also holds
    the conv state before each p in capture (its last K - 1 inputs), exactly."""
    width, n = conv_state.shape[1], x.shape[0]
    ext = torch.cat([conv_state, x.transpose(0, 1)], dim=1)  # [C, K - 1 + n], from position start - K + 1
    out = F.conv1d(ext[None], weight[:, None, :], groups=weight.shape[0])[0].transpose(0, 1)
    if capture is None:
        return out, ext[:, n:]
    check_captures(capture, start, n)
    return out, ext[:, n:], [ext[:, p - start:p - start + width] for p in capture]


class KimiDeltaAttention(nn.Module):
    """The KDA state layer a model instantiates for layer `layer_name`: it owns no weights, only
    the state slot's read/write, the short conv and the delta rule.

    forward(mixed_qkv [T, 3 * H * D] (projections before the conv), conv_weight [3 * H * D, K],
            g [T, H, D] (log decay, <= 0), beta [T, H], ctx) -> o [T, H, D]
    """

    # C1: the layer reads only state it wrote; a new request's zero state comes from
    # LinearStateSpec.starts_zeroed, not from this declaration.
    reads_unwritten_slots = False
    # Prefill chunks end at absolute positions that are multiples of this: where states resume exactly.
    chunk_size = CHUNK_SIZE

    def __init__(self, layer_name: str, num_heads: int, head_dim: int, conv_kernel_size: int, *, dtype: torch.dtype):
        super().__init__()
        if conv_kernel_size < 2:
            raise ValueError(f"KDA needs a short conv kernel of at least 2, got {conv_kernel_size}")
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 3 * num_heads * head_dim
        self.dtype = dtype  # the model's (states are float32)

    def kv_cache_spec(self, block_size: int) -> LinearStateSpec:
        """One state slot per request, whatever `block_size`: the conv state and the recurrent state."""
        return LinearStateSpec(
            shapes=((self.conv_dim, self.conv_kernel_size - 1), (self.num_heads, self.head_dim, self.head_dim)),
            dtypes=("float32",) * 2,
            chunk_size=self.chunk_size,
        )

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_name)
        meta: StateMetadata
        conv_states, rec_states = cache.tensors
        layout = meta.layout
        dtype = mixed_qkv.dtype  # the recurrence runs in float32, as its states are stored
        mixed_qkv, conv_weight, g, beta = (t.float() for t in (mixed_qkv, conv_weight, g, beta))
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], self.num_heads, self.head_dim)
        nd = layout.num_decodes
        if nd:
            def features(mixed, rows):
                return *self._split(silu(mixed)), g[rows], beta[rows]

            native = state_recurrence_ops() if out.device.type == "cpu" else None
            run_decodes(self.layer_name, meta, (conv_states, rec_states), out,
                        StateDecode(mixed_qkv, conv_weight, None, features, kda_step,
                                    None if native is None else native.delta_rule_rows))
        for i in range(nd, layout.num_seqs):
            start, end = layout.query_start[i], layout.query_start[i + 1]
            slot, first = meta.slot_ids[i], layout.seq_lens[i] - (end - start)
            positions, targets = capture_targets(meta.captures.get(i))
            x, conv_states[slot], *conv_caps = causal_conv(mixed_qkv[start:end], conv_states[slot], conv_weight,
                                                           first, positions)
            q, k, v = self._split(silu(x))
            out[start:end], rec_states[slot], *rec_caps = kda_chunked(
                q, k, v, g[start:end], beta[start:end], rec_states[slot], self.chunk_size, first, positions)
            if positions:
                conv_states[targets], rec_states[targets] = torch.stack(conv_caps[0]), torch.stack(rec_caps[0])
        return out.to(dtype)

    def _split(self, x: torch.Tensor):
        """Conv outputs [N, 3 * H * D] -> q (normalised, scaled), k (normalised), v, each [N, H, D]."""
        q, k, v = x.view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return l2norm(q) * self.head_dim**-0.5, l2norm(k), v
