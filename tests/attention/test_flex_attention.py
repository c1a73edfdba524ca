"""The FlexAttention backend (`flex`) on CPU: parity with the exact-length backend on tiny paged
steps (prefill, decode, mixed, sliding window, prefix hit), its C1 declaration under poison, and
tiny Llama / Gemma 3 engines giving the exact backend's greedy tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.flex_attention import FLEX_UNAVAILABLE, Q_BLOCK, FlexAttention, step_mask
from blockserve.attention.metadata import AttentionMetadata, BatchLayout, to_device
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.random_checkpoint import save_random_model
from tests.attention.test_paged_attention import BS, HKV, NUM_BLOCKS, D, make_step

pytestmark = [pytest.mark.skipif(FLEX_UNAVAILABLE is not None, reason=f"FlexAttention unavailable: {FLEX_UNAVAILABLE}"),
              pytest.mark.usefixtures("one_torch_thread")]

STEPS = {  # (tokens computed before the step, query tokens), decodes first
    "prefill": [(0, 9), (0, 3)],
    "decode": [(5, 1), (12, 1), (3, 1), (16, 1)],
    "mixed": [(5, 1), (12, 1), (0, 9), (6, 5), (8, 4)],
}


def forward(name: str, seqs, window=None, fill=0.0, share_first_block=False, zero_tables=False):
    """One step of backend `name` over make_step's caches; `share_first_block`: the last sequence's
    first block is the first sequence's (a prefix hit: same tokens, same block); `zero_tables`:
    with fill NaN, every block a table names is zeroed before the earlier tokens are written."""
    k_cache, v_cache, table, q, k, v, full_k, full_v = make_step(seqs, fill=fill)
    if share_first_block:
        table[-1, 0] = table[0, 0]
    if zero_tables:
        used = table.unique()
        for cache in (k_cache, v_cache):
            cache[used] = torch.nan_to_num(cache[used], nan=0.0)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    meta = AttentionMetadata.build(layout, table, BS, window)
    return BACKENDS[name](1 / math.sqrt(D)).forward(q, k, v, k_cache, v_cache, meta)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_matches_exact_backend(step, window):
    torch.testing.assert_close(forward("flex", STEPS[step], window), forward("exact", STEPS[step], window),
                               rtol=1e-5, atol=1e-5)


def test_prefix_hit_reads_the_shared_block_once():
    """Two sequences name the same physical block at column 0 (the second starts mid-sequence
    after a prefix hit): the compact KV holds it once, and both read it."""
    seqs = [(6, 1), (7, 3)]  # the second's first block (4 computed tokens) is the first's
    torch.testing.assert_close(forward("flex", seqs, share_first_block=True),
                               forward("exact", seqs, share_first_block=True), rtol=1e-5, atol=1e-5)


def test_stale_table_entries_are_ignored():
    """Entries past a sequence's last block may be stale ids (the model runner's table is not
    cleared): one naming another sequence's block, the others a free block full of NaN. Neither
    is read, and the other sequence's block keeps its own column."""
    seqs = STEPS["mixed"]
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=float("nan"))
    used = table.unique()
    for cache in (k_cache, v_cache):
        cache[used] = torch.nan_to_num(cache[used], nan=0.0)
    free = next(b for b in range(NUM_BLOCKS) if b not in used.tolist())
    stale = torch.tensor([int(table[2, 1])] + [free] * (len(seqs) - 1))[:, None]
    table = torch.cat([table, stale], dim=1)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    outs = [BACKENDS[name](1 / math.sqrt(D)).forward(q, k, v, k_cache.clone(), v_cache.clone(),
                                                       AttentionMetadata.build(layout, table, BS))
            for name in ("flex", "exact")]
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_gqa_heads_map_to_their_kv_head():
    """Changing KV head 1's values changes only the query heads that share it."""
    seqs = STEPS["mixed"]
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=0.0)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    backend = FlexAttention(1 / math.sqrt(D))
    base = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), AttentionMetadata.build(layout, table, BS))
    v2, v_cache2 = v.clone(), v_cache.clone()
    v2[:, 1] += 1
    v_cache2[:, :, 1] += 1
    moved = backend.forward(q, k, v2, k_cache.clone(), v_cache2, AttentionMetadata.build(layout, table, BS))
    group = q.shape[1] // HKV
    torch.testing.assert_close(moved[:, :group], base[:, :group])
    assert not torch.allclose(moved[:, group:], base[:, group:])


@pytest.mark.parametrize("window", [None, 5])
def test_poison_c1(window):
    """C1: flex reads whole pages (reads_unwritten_slots = True). With every unwritten slot NaN it
    turns NaN; with the blocks its tables name zeroed (what the derived flag orders) it equals the
    clean run, NaN in every free block notwithstanding."""
    seqs = STEPS["mixed"]
    assert FlexAttention.reads_unwritten_slots
    clean = forward("flex", seqs, window)
    assert forward("flex", seqs, window, fill=float("nan")).isnan().any()
    assert torch.equal(forward("flex", seqs, window, fill=float("nan"), zero_tables=True), clean)


LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
GEMMA3 = dict(LLAMA, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"])
MODELS = {"llama": lambda: LlamaConfig(**LLAMA), "gemma3": lambda: Gemma3TextConfig(**GEMMA3)}


def engine_greedy_tokens(path, backends, **options) -> dict[str, list[list[int]]]:
    """Per backend, the greedy tokens of batched prompts (two sharing a prefix) through an engine with
    chunked prefill, prefix caching (hits asserted), poison on and the derived zero flags (asserted);
    `options`: more engine options (a kv_cache_dtype)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 500, (9,), generator=gen).tolist()
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 11)]
    prompts += [shared + [5, 6], shared + [7]]
    params = SamplingParams(temperature=0, max_tokens=6)
    tokens = {}
    for backend in backends:
        llm = LLM(str(path), block_size=4, attention_backend=backend, max_num_batched_tokens=8, poison=True,
                  check_integrity=True, kv_cache_memory="1MiB", enable_prefix_caching=True, **options)
        assert all(g.zero_new_blocks == BACKENDS[backend].reads_unwritten_slots
                   for g in llm.engine.core.kv_config.groups)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.kv.prefix_cache_stats().hits > 0
    return tokens


@pytest.mark.parametrize("family", sorted(MODELS))
def test_engine_greedy_tokens_equal_exact(family, tmp_path):
    """The greedy tokens of attention_backend='flex' equal 'exact''s (engine_greedy_tokens)."""
    save_random_model(MODELS[family](), tmp_path)
    tokens = engine_greedy_tokens(tmp_path, ("exact", "flex"))
    assert tokens["flex"] == tokens["exact"]


def sparsity_step(kind: str, window):
    """Metadata of a step whose tables end in stale ids (another sequence's block, a free block, the
    null block). "decodes": 20 decodes (two tiles of rows) and a 14-token prefill chunk; decodes 0, 3
    and 5 (one tile) and 19 (the next) share their first block, as prefix hits do. "chunks": 2 decodes
    sharing their first block, then chunks of 40 and 5 tokens (at most 3 sequences a tile)."""
    if kind == "decodes":
        computed = [4, 9, 2, 13, 6, 5, 11, 3, 8, 12, 7, 1, 10, 4, 6, 9, 2, 14, 5, 7]
        seqs, sharing = [(c, 1) for c in computed] + [(10, 14)], (3, 5, 19)
    else:
        seqs, sharing = [(6, 1), (5, 1), (3, 40), (30, 5)], (1,)
    free = iter(range(1, 500))
    tables = [[next(free) for _ in range(-(-(c + n) // BS))] for c, n in seqs]
    for i in sharing:
        tables[i][0] = tables[0][0]
    width = max(len(t) for t in tables) + 3
    rows = [t + [tables[1][1], 499, 0] + [0] * (width - 3 - len(t)) for t in tables]
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    return AttentionMetadata.build(layout, torch.tensor(rows), BS, window)


PATHS = {"cpu": dict(static_shapes=False, compact=True), "cuda_eager": dict(static_shapes=False, compact=False),
         "captured": dict(static_shapes=True, compact=False)}  # step_mask's three, all run on the CPU here


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", ["decodes", "chunks"])
def test_block_sparsity_lists_each_tile_its_pages_once(kind, window, path):
    """The block mask's per-tile page lists are what the CUDA kernel visits (eager CPU ignores them,
    so only this test checks them): each tile lists, ascending and once, the pages in its rows'
    [key_start, position] ranges, which hold every key mask_mod lets them see. The lists are sized
    by the step's table width and the sequences a tile holds (one row stands for a sequence's rows in
    a tile, all rows in a captured step), not by the cache (`num_pages`) or the rows a chunk has."""
    meta = sparsity_step(kind, window)
    meta.static_shapes = PATHS[path]["static_shapes"]
    num_pages = 100_000
    mask = step_mask(meta, num_pages, torch.device("cpu"), PATHS[path]["compact"])
    counts, indices = mask.block_mask.kv_num_blocks[0, 0], mask.block_mask.kv_indices[0, 0]
    kv_index = ({p: p for p in range(num_pages)} if mask.pages is None
                else {p: i for i, p in enumerate(mask.pages.tolist())})
    kv_len = len(kv_index)
    sequences_a_tile = Q_BLOCK if kind == "decodes" or path == "captured" else 3
    assert indices.shape[-1] == min(sequences_a_tile * meta.block_table.shape[1], kv_len)

    seq, pos, table = meta.layout.seq_of_token.tolist(), meta.layout.positions.tolist(), meta.block_table.tolist()
    visible = mask.block_mask.mask_mod(0, 0, torch.arange(len(seq))[:, None], torch.arange(kv_len * BS)[None])
    for tile in range(counts.shape[0]):
        tile_rows = range(tile * Q_BLOCK, min(len(seq), (tile + 1) * Q_BLOCK))
        want = {kv_index[table[seq[m]][c]] for m in tile_rows
                for c in range(meta.key_starts[seq[m]] // BS, pos[m] // BS + 1) if table[seq[m]][c] != 0}
        listed = indices[tile, :counts[tile]].tolist()
        assert listed == sorted(want)
        seen = set((visible[list(tile_rows)].any(0).nonzero().flatten() // BS).tolist())
        assert seen <= want and (window is not None or seen == want)
    shared = kv_index[table[0][0]]
    assert indices[0, :counts[0]].tolist().count(shared) == 1
    assert kind == "chunks" or shared in indices[1, :counts[1]].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cuda_eager", "captured"])
@pytest.mark.parametrize("kind", ["decodes", "chunks"])
def test_block_sparsity_on_cuda(kind, path):
    """The per-tile page lists built on CUDA (its sort, scatter and index_put; tile_rows' rows moved
    from the host) equal those built on the CPU, which the test above checks."""
    lists = []
    for device in ("cpu", "cuda"):
        host = sparsity_step(kind, 5)
        meta = host if device == "cpu" else host.with_tensors(*to_device(host.tensors(), torch.device(device)))
        meta.static_shapes = PATHS[path]["static_shapes"]
        mask = step_mask(meta, 100_000, torch.device(device), compact=False).block_mask
        lists.append((mask.kv_num_blocks.cpu(), mask.kv_indices.cpu()))
    assert torch.equal(lists[0][0], lists[1][0]) and torch.equal(lists[0][1], lists[1][1])
