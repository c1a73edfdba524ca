"""Run a model through paged caches as the engine would, without the engine (its outputs are held
to transformers' with tests/parity.py).

`run_paged` groups the model's KV layers as the engine does (one group per distinct spec and
backend declaration) in the worker's own `KVCacheTensors`, in poison mode: every block and state
slot starts as NaN, and a sequence's blocks are zeroed when handed out only where the group's C1
flag (`zero_new_blocks`) says so. Each sequence gets its blocks scattered over each attention / MLA
pool and one slot in each state pool; every pool holds twice what the sequences need, so NaN
blocks sit among theirs (block 0, the null block, is zero). Sliding-window blocks wholly before
the window are poisoned again and their table entries point at the null block, as
SlidingWindowManager releases them. A read of anything neither written nor zeroed turns the
logits NaN (the prompt's are returned; a NaN decode step picks token 0).

    step 0   [p0 p0 p0 p0 p0]                      seq 0 prefills (the whole prompt, or a chunk)
    step 1   [d0][p1 p1 p1]                        seq 1 joins (stagger): decode + prefill
    step 2   [d0][d1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockserve.attention.context import ForwardContext, StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import LinearStateSpec, SlidingWindowSpec, cdiv, zero_new_blocks
from blockserve.worker.kv_tensors import KVCacheTensors


@dataclass
class _Seq:
    prompt: list[int]
    start_step: int
    tables: list[list[int]] = field(default_factory=list)  # per group: block ids (a state group: one slot)
    computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


@torch.inference_mode()
def run_paged(model, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4, chunk: int | None = None,
              stagger: bool = False, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Greedy generation of `max_new_tokens` per prompt through paged caches of every kind the model
    declares (see the module docstring).

    `chunk`: prefill tokens per step (None: the whole prompt at once). `stagger`: sequence i joins at
    step i, so prefill chunks and decodes share steps. Returns, per prompt, the logits of every
    prompt position [L, vocab] and the generated token ids.
    """
    seqs = [_Seq(p, i if stagger else 0) for i, p in enumerate(prompts)]
    kv, groups = _scattered_caches(model, seqs, max_new_tokens, block_size, seed)
    layers = kv.layer_caches()
    step = 0
    while any(len(s.generated) < max_new_tokens for s in seqs):
        batch = _step_batch(seqs, step, max_new_tokens, chunk)
        layout = BatchLayout.build([len(t) for _, t in batch], [s.computed for s, _ in batch])
        metadata = [_metadata(group, layout, [s.tables[g] for s, _ in batch]) for g, group in enumerate(groups)]
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = model.compute_logits(model(input_ids, layout.positions, ForwardContext(layers, metadata)))
        for i, (s, tokens) in enumerate(batch):
            rows = logits[layout.query_start[i]: layout.query_start[i + 1]]
            if s.computed < len(s.prompt):
                s.prompt_logits.append(rows)
            s.computed += len(tokens)
            if s.computed >= len(s.prompt):
                s.generated.append(int(rows[-1].argmax()))
            _release_out_of_window(kv, groups, s)
        step += 1
    return [torch.cat(s.prompt_logits) for s in seqs], [s.generated for s in seqs]


def _scattered_caches(model, seqs: list[_Seq], max_new_tokens: int, block_size: int, seed: int):
    """The poisoned caches and their groups, each sequence's blocks drawn at random from each pool
    (its `tables`), zeroed where the group's C1 flag says so."""
    reads_unwritten = {m.layer_name: m.reads_unwritten_slots for m in model.modules()
                       if hasattr(m, "layer_name") and hasattr(m, "reads_unwritten_slots")}
    layer_groups: dict[tuple, list[str]] = {}
    for name, spec in model.kv_cache_specs(block_size).items():
        layer_groups.setdefault((spec, reads_unwritten[name]), []).append(name)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for (spec, reads), names in layer_groups.items():
        if isinstance(spec, LinearStateSpec):
            need = [1] * len(seqs)
        else:
            need = [cdiv(len(s.prompt) + max_new_tokens, block_size) for s in seqs]
        num_blocks = 1 + 2 * sum(need)
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for s, n in zip(seqs, need):
            s.tables.append(order[:n])
            order = order[n:]
        groups.append(KVCacheGroup(spec, num_blocks, zero_new_blocks(spec, reads), tuple(names)))
    kv = KVCacheTensors(KVCacheConfig(tuple(groups), poison_freed_blocks=True), device="cpu")
    for g, group in enumerate(groups):
        if group.zero_new_blocks:
            kv.zero_blocks(g, [block for s in seqs for block in s.tables[g]])
    return kv, groups


def _step_batch(seqs: list[_Seq], step: int, max_new_tokens: int, chunk: int | None) -> list[tuple[_Seq, list[int]]]:
    """(sequence, tokens to feed) for every sequence taking part in `step`, decodes first: a prefill
    chunk for those with prompt left (the whole prompt when `chunk` is None), else the last token."""
    batch = []
    for s in seqs:
        if step < s.start_step or len(s.generated) == max_new_tokens:
            continue
        if s.computed < len(s.prompt):
            tokens = s.prompt[s.computed: s.computed + (chunk or len(s.prompt))]
        else:
            tokens = [s.generated[-1]]
        batch.append((s, tokens))
    batch.sort(key=lambda item: len(item[1]) > 1)
    return batch


def _metadata(group: KVCacheGroup, layout: BatchLayout, tables: list[list[int]]):
    """The group's metadata for the step: its slots (a state group) or block tables padded with the
    null block (with the window for a sliding group)."""
    if group.is_state:
        return StateMetadata(layout, torch.tensor([table[0] for table in tables]))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    window = group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None
    return AttentionMetadata.build(layout, table, group.spec.block_size, window)


def _release_out_of_window(kv: KVCacheTensors, groups: list[KVCacheGroup], seq: _Seq) -> None:
    """As SlidingWindowManager does, release the blocks wholly before the window: poison them and
    point their table entries at the null block."""
    for g, group in enumerate(groups):
        if not isinstance(group.spec, SlidingWindowSpec):
            continue
        table = seq.tables[g]
        for i in range(min(group.spec.num_skipped_tokens(seq.computed) // group.spec.block_size, len(table))):
            if table[i]:
                kv.poison_blocks(g, [table[i]])
                table[i] = 0
