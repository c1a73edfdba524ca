"""Both MLA flavours against dense (expanded, unpaged) attention, and their C1 behaviour under poison."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.mla import MLA_BACKENDS

H, DN, DR, DV, R, BS, NUM_BLOCKS = 4, 8, 4, 6, 16, 4, 40
SCALE = (DN + DR) ** -0.5
SEQS = [(5, 1), (12, 1), (3, 1), (0, 9), (6, 5), (8, 4)]  # (computed, query length), decodes first


def dense_reference(q, c, k_rope, w_uk, w_uv, query_pos):
    """q [n, H, DN + DR] at query_pos; latents c [L, R], k_rope [L, DR] of positions 0..L-1."""
    keys = torch.cat([torch.einsum("lr,hdr->hld", c, w_uk), k_rope[None].expand(H, -1, -1)], dim=-1)
    values = torch.einsum("lr,hvr->hlv", c, w_uv)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * SCALE  # [H, n, L]
    mask = torch.arange(c.shape[0])[None] <= query_pos[:, None]
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).transpose(0, 1)


def make_step(fill: float):
    """A cache (every non-null row = fill) with earlier tokens written, tables, the step's inputs."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((NUM_BLOCKS, BS, R + DR), fill)
    cache[0] = 0  # the null block
    free = list(range(1, NUM_BLOCKS))
    tables, latents, ropes = [], [], []
    for computed, n in SEQS:
        total = computed + n
        blocks = [free.pop(7 % len(free)) for _ in range(-(-total // BS))]
        tables.append(blocks)
        c, kr = torch.randn(total, R, generator=gen), torch.randn(total, DR, generator=gen)
        latents.append(c)
        ropes.append(kr)
        for p in range(computed):
            cache[blocks[p // BS], p % BS] = torch.cat([c[p], kr[p]])
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [7] * (width - len(t)) for t in tables])  # stale ids past each table's end
    t = sum(n for _, n in SEQS)
    q = torch.randn(t, H, DN + DR, generator=gen)
    w_uk, w_uv = torch.randn(H, DN, R, generator=gen) / 4, torch.randn(H, DV, R, generator=gen) / 4
    layout = BatchLayout.build([n for _, n in SEQS], [c for c, _ in SEQS])
    meta = AttentionMetadata.build(layout, table, BS)
    step_c = torch.cat([c[comp:] for c, (comp, _) in zip(latents, SEQS)])
    step_r = torch.cat([kr[comp:] for kr, (comp, _) in zip(ropes, SEQS)])
    return cache, meta, q, step_c, step_r, w_uk, w_uv, latents, ropes


def run(backend_name: str, fill: float):
    cache, meta, q, c, kr, w_uk, w_uv, latents, ropes = make_step(fill)
    out = MLA_BACKENDS[backend_name](SCALE).forward(q[..., :DN], q[..., DN:], c, kr, w_uk, w_uv, cache, meta)
    return out, (q, w_uk, w_uv, latents, ropes, meta)


@pytest.mark.parametrize("backend", sorted(MLA_BACKENDS))
def test_matches_dense_attention(backend):
    out, (q, w_uk, w_uv, latents, ropes, meta) = run(backend, 0.0)
    layout = meta.layout
    for i, (computed, n) in enumerate(SEQS):
        s, e = layout.query_start[i], layout.query_start[i + 1]
        want = dense_reference(q[s:e], latents[i], ropes[i], w_uk, w_uv, torch.arange(computed, computed + n))
        torch.testing.assert_close(out[s:e], want, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_equals_expanded_prefill():
    """The same queries as decodes (absorbed form) and as a 1-token chunk (expanded form)."""
    backend = MLA_BACKENDS["exact"](SCALE)
    cache, meta, q, c, kr, w_uk, w_uv, *_ = make_step(0.0)
    as_decode = backend.forward(q[:1, :, :DN], q[:1, :, DN:], c[:1], kr[:1], w_uk, w_uv, cache.clone(),
                                AttentionMetadata.build(BatchLayout.build([1], [5]), meta.block_table[:1], BS))
    layout = BatchLayout.build([1], [5])
    layout.num_decodes = 0  # force the prefill (expanded) path for the same single token
    as_prefill = backend.forward(q[:1, :, :DN], q[:1, :, DN:], c[:1], kr[:1], w_uk, w_uv, cache.clone(),
                                 AttentionMetadata.build(layout, meta.block_table[:1], BS))
    torch.testing.assert_close(as_decode, as_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(MLA_BACKENDS))
def test_poisoned_unwritten_rows(backend):
    """C1: with every unwritten row NaN, the exact-length flavour is bit-identical to a zeroed
    cache; the whole-block flavour, which weights the unwritten tail by zero, turns to NaN."""
    clean, _ = run(backend, 0.0)
    poisoned, _ = run(backend, float("nan"))
    if MLA_BACKENDS[backend].reads_unwritten_slots:
        assert poisoned.isnan().any()
    else:
        assert torch.equal(poisoned, clean)
