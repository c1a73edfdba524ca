"""Prefix caching for hybrid models end to end: tiny random Qwen3-Next (Gated DeltaNet), Granite
4.0-H (Mamba2) and Kimi Linear (KDA + MLA) through the real loader and LLM.generate.

Multi-turn conversations with a shared system prompt, each turn of every conversation submitted
together (as a server sees them), each next prompt the history plus the reply plus a new message.
Greedy tokens equal transformers' and caching on equals caching off, under chunk caps {a small
odd number, the checkpoint stride, the step budget}, forced preemption and poison; turns from the
second on restore state checkpoints. Then the cases other engines get wrong, one test each.

Exactness: a restored state resumes the kernels' chunk grid on absolute positions, so the scan
is the one computed through; what differs is the shape elementwise ops (silu, softplus, the
conv) run over, which moves float32 results by rounding only. No token differs here; the
parity rule allows no near-tie.
"""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.kv import LinearStateSpec
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 (a fixture)
from tests.parity import assert_greedy_parity, reference_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
NEW_TOKENS = 6
MAX_MODEL_LEN = 192
FAMILIES = ("granitemoehybrid", "kimi_linear", "qwen3_next")


def tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def conversations(request, tiny_model):
    """(family, model path, turns): turns[k] = [(prompt of conversation c at turn k, transformers'
    reference for it)], each next prompt built from the reference's own reply."""
    path, reference = tiny_model(request.param)
    gen = torch.Generator().manual_seed(3)
    system = tokens(gen, 70)  # past one 64-token stride, short of two
    histories = [system + tokens(gen, 5 + 6 * c) for c in range(4)]
    turns = []
    for _ in range(3):
        expected = reference_outputs(reference, histories, NEW_TOKENS)
        turns.append(list(zip(histories, expected)))
        histories = [h + reply + tokens(gen, 9) for h, (reply, _) in zip(histories, expected)]
    return request.param, path, turns


def slot_and_block_bytes(llm_config_model) -> tuple[int, int]:
    specs = llm_config_model.kv_cache_specs(BLOCK_SIZE).values()
    slot = sum(s.page_size_bytes for s in specs if isinstance(s, LinearStateSpec))
    block = sum(s.page_size_bytes for s in specs if not isinstance(s, LinearStateSpec))
    return slot, block


def run_turns(llm: LLM, turns) -> list[list[int]]:
    """Every turn's prompts, one round per turn; the hit of each request in order."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    hits = []
    for turn in turns:
        outputs = llm.generate([prompt for prompt, _ in turn], params, use_tqdm=False)
        assert_greedy_parity([o.outputs[0].token_ids for o in outputs], [ref for _, ref in turn])
        hits.append([o.num_cached_tokens for o in outputs])
    llm.engine.core.scheduler.assert_idle()
    return hits


# Chunk caps against the checkpoint stride (the engine scenarios of tests/scenarios.py, for
# checkpoints): a small odd number, the stride, the step budget; and poison.
CHECKPOINT_SCENARIOS = {
    "odd-chunk": dict(max_prefill_chunk=7),
    "stride-chunk": dict(max_prefill_chunk=64),
    "budget-chunk": dict(),
    "poison": dict(poison=True),
}


@pytest.mark.parametrize("scenario", sorted(CHECKPOINT_SCENARIOS))
def test_multi_turn_hits_and_equals_transformers(conversations, scenario):
    family, path, turns = conversations
    llm = LLM(str(path), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB",
              check_integrity=True, **CHECKPOINT_SCENARIOS[scenario])
    hits = run_turns(llm, turns)
    stats = llm.engine.core.scheduler.kv.prefix_cache_stats()
    stride = llm.engine.core.kv_config.checkpoint_stride
    assert stride == (8 if family == "granitemoehybrid" else 64)
    # From turn 2 on every request restores at least the previous turn's prompt end.
    for k in (1, 2):
        for c, hit in enumerate(hits[k]):
            previous_prompt = len(turns[k - 1][c][0])
            assert hit >= previous_prompt // stride * stride > 0, (k, c, hits)
    assert stats.checkpoint_restores >= 8 and stats.checkpoint_captures > 0, stats


def test_preemption_with_a_small_cache(conversations):
    family, path, turns = conversations
    probe = LLM(str(path), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB")
    slot, block = slot_and_block_bytes(probe.engine.core.loaded.model)
    max_num_seqs, max_model_len = 4, 144
    # The state slots, 37 attention blocks (one longest request needs 36; the last turn's four
    # need about 60) and 12 checkpoints.
    memory = (max_num_seqs + 1 + 12) * slot + 38 * block + 1
    llm = LLM(probe.engine.core.loaded, block_size=BLOCK_SIZE, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              kv_cache_memory=memory, state_checkpoint_share=12 * slot / memory, check_integrity=True, poison=True)
    hits = run_turns(llm, turns)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert sum(hits[1]) + sum(hits[2]) > 0


def test_caching_off_equals_on(conversations):
    _, path, turns = conversations
    llm = LLM(str(path), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    assert all(h == 0 for turn in run_turns(llm, turns) for h in turn)
