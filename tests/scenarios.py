"""The scenario matrix the model and engine tests of every family run (held to transformers with
tests/parity.py).

Backends (`SUITE_BACKENDS`): the CPU paged attention backends `exact` and `whole_block`. `flex`
(FlexAttention: eager and slow on the CPU, ~3 minutes over these tests) is marked `backend_full`,
deselected by default, and has its own parity, poison and engine tests
(tests/attention/test_flex_attention.py, the MLA kernel tests). `triton` (its kernel in Triton's
interpreter) likewise has its own (tests/attention/test_triton_attention.py, the MLA kernel tests,
the CUDA graph replays).

Engine scenarios (`ENGINE_SCENARIOS`, `engine_options`): a batch through LLM.generate with prefix
caching on (a second pass may be served from the cache) and off, chunked prefill forced by a small
step budget, and preemption forced by a KV cache too small for the batch (each family sizes its own).

Paged scenarios (`PAGED_SCENARIOS`): the model alone through tests/paged_harness.py, one prompt in
one piece, three staggered in chunks (decodes and prefill chunks share steps), one in two chunks.
"""

from __future__ import annotations

import pytest
import torch

SUITE_BACKENDS = ["exact", "whole_block", pytest.param("flex", marks=pytest.mark.backend_full)]

ENGINE_SCENARIOS = ["chunked-prefill", "no-prefix-caching", "preemption", "prefix-caching"]


def engine_options(scenario: str, *, preemption: dict, base: dict | None = None, chunk_budget: int = 7) -> dict:
    """The LLM options of `scenario`, over `base`: prefix caching on or off, a step budget of
    `chunk_budget` tokens, or `preemption` (the family's small cache)."""
    options = {
        "prefix-caching": dict(enable_prefix_caching=True),
        "no-prefix-caching": dict(enable_prefix_caching=False),
        "chunked-prefill": dict(max_num_batched_tokens=chunk_budget),
        "preemption": preemption,
    }[scenario]
    return {**(base or {}), **options}


def engine_prompts(vocab: int = 512) -> list[list[int]]:
    """Seven prompts of 3 to 30 tokens; the last three share a 13-token prefix."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (13,), generator=gen).tolist()
    out = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 21, 30)]
    out += [shared + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (2, 5, 8)]
    return out


PAGED_SCENARIOS = {  # name -> (indices into paged_prompts(), run_paged options)
    "single": ([1], {}),
    "batch-of-3": ([0, 1, 2], {"stagger": True, "chunk": 6}),  # decodes and prefill chunks share steps
    "two-chunks": ([2], {"chunk": 9}),
}


def paged_prompts(vocab: int = 512) -> list[list[int]]:
    """Three prompts of 5, 11 and 17 tokens."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 11, 17)]
