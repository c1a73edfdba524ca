"""A paged-cache harness: run a model over sequences as the engine would, without the engine.

Each sequence gets its own blocks, scattered over the cache (block 0 is the null block, never
handed out). Every step builds the layout, metadata and context for the sequences taking part:
a prefill chunk for those with prompt left, one token for the others, decodes first.

    step 0   [p0 p0 p0 p0 p0]                      seq 0 prefills (start 0)
    step 1   [d0][p1 p1 p1]                        seq 1 joins (start 1): decode + prefill
    step 2   [d0][d1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.metadata import AttentionMetadata, BatchLayout


@dataclass
class _Seq:
    prompt: list[int]
    start_step: int
    blocks: list[int]
    computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


def step_batch(seqs, step: int, max_new_tokens: int, chunk: int | None) -> list:
    """(sequence, tokens to feed) for every sequence taking part in `step`, decodes first: a
    prefill chunk for those with prompt left (whole prompt when `chunk` is None), else the last
    generated token. Sequences have prompt, computed, generated and start_step."""
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


@torch.inference_mode()
def run_paged(model, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4, chunk: int | None = None,
              stagger: bool = False, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Greedy generation of `max_new_tokens` per prompt through the paged cache.

    `chunk`: prefill tokens per step (None: the whole prompt at once). `stagger`: sequence i joins
    at step i, so prefill chunks and decodes share steps. Returns, per prompt, the logits of
    every prompt position [L, vocab] and the generated token ids.
    """
    specs = model.kv_cache_specs(block_size)
    need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    num_blocks = 1 + sum(need)
    order = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs.append(_Seq(prompt, i if stagger else 0, order[:need[i]]))
        order = order[need[i]:]
    layers = {
        name: LayerCache(0, torch.zeros(num_blocks, block_size, spec.num_kv_heads, spec.head_size),
                         torch.zeros(num_blocks, block_size, spec.num_kv_heads, spec.head_size))
        for name, spec in specs.items()
    }
    step = 0
    while any(len(s.generated) < max_new_tokens for s in seqs):
        batch = step_batch(seqs, step, max_new_tokens, chunk)
        layout = BatchLayout.build([len(t) for _, t in batch], [s.computed for s, _ in batch])
        width = max(len(s.blocks) for s, _ in batch)
        table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s, _ in batch])
        ctx = ForwardContext(layers, [AttentionMetadata.build(layout, table, block_size)])
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = model.compute_logits(model(input_ids, layout.positions, ctx))
        for i, (s, tokens) in enumerate(batch):
            rows = logits[layout.query_start[i]: layout.query_start[i + 1]]
            if s.computed < len(s.prompt):
                s.prompt_logits.append(rows)
            s.computed += len(tokens)
            if s.computed >= len(s.prompt):
                s.generated.append(int(rows[-1].argmax()))
        step += 1
    return [torch.cat(s.prompt_logits) for s in seqs], [s.generated for s in seqs]


def save_random_model(hf_config, path, seed: int = 0):
    """Build a transformers model from `hf_config` with weights far from uniform logits (norms
    near 1, other weights N(0, 0.2)), save it to `path`, and return it as the reference."""
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
    reference.save_pretrained(path)
    return reference
