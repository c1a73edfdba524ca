"""Speculative decoding on hybrid models (Gated DeltaNet: Qwen3-Next, Mamba2: Granite 4.0-H, KDA + MLA:
Kimi Linear): greedy tokens identical with and without speculation, with prefix caching on (state
checkpoints captured while decoding, some past rejected drafts) and off, chunked prefill,
preemption and poison. The drafts come from an oracle that knows the greedy reply and spoils it
after a varying number of right tokens, so every verification keeps some drafts and rolls back
the rest: a rollback bug (a slot left holding a rejected draft's state, a checkpoint cached
after one) changes the tokens that follow. N-gram and suffix drafts, and an attention-only draft
model, run too."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.context import StateCache
from blockserve.kv import LinearStateSpec
from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts
from tests.engine.test_draft_model_engine import DRAFT_SIZES
from tests.models.conftest import MLA_CONFIGS, STATE_CONFIGS, VOCAB, tiny_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
NEW_TOKENS = 20
BASE = dict(block_size=4, max_model_len=128, kv_cache_memory="8MiB", check_integrity=True, poison=True)
SCENARIOS = {
    "caching": {},
    "no-caching": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},
    "preemption": {},  # a cache of a few blocks: see small_cache
    "async": {"async_scheduling": True},  # a verified step is settled before the next is scheduled
}


def small_cache(llm: LLM) -> dict:
    """Options for a cache of 4 state slots, room for 2 checkpoints and about 20 attention blocks (the
    four requests need about 40 together): requests are preempted."""
    specs = llm.engine.core.loaded.model.kv_cache_specs(BASE["block_size"]).values()
    slot = sum(s.page_size_bytes for s in specs if isinstance(s, LinearStateSpec))
    block = sum(s.page_size_bytes for s in specs if not isinstance(s, LinearStateSpec))
    memory = (4 + 1 + 2) * slot + 20 * block + 1
    return dict(kv_cache_memory=memory, max_num_seqs=4, max_model_len=48, state_checkpoint_share=2 * slot / memory)


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


class OracleProposer:
    """Drafts the known greedy continuation of a prompt, the first `right` tokens right (`right` varies
    with the length) and the rest one off; nothing for a prompt it does not know."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]]):
        self.replies = replies

    def propose(self, request_id, token_ids, max_tokens: int) -> list[int]:
        for prompt, reply in self.replies.items():
            done = len(token_ids) - len(prompt)
            if done >= 0 and tuple(token_ids[:len(prompt)]) == prompt and list(token_ids[len(prompt):]) == reply[:done]:
                truth = reply[done:done + max_tokens]
                right = (len(token_ids) * 7 + 3) % (len(truth) + 1)  # 7: prime to every k + 1 <= 6
                return truth[:right] + [(t + 1) % VOCAB for t in truth[right:]]
        return []

    def forget(self, request_id) -> None:
        """Holds nothing per request."""

    @property
    def num_requests(self) -> int:
        return 0


def prompts() -> list[list[int]]:
    """Repetitive prompts (lookup finds drafts, the random model rejects many) and a plain one."""
    gen = torch.Generator().manual_seed(5)
    loop = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
    return [loop * 5, loop * 3 + [1, 2], torch.randint(0, VOCAB, (11,), generator=gen).tolist(), [3, 4] * 7]


def run(llm: LLM, turns: int = 1) -> list[list[int]]:
    """Greedy tokens of every prompt; with turns > 1, each next prompt repeats the last one and its reply
    (a second turn restores the state checkpoint its first turn's decoding captured)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    current, out = prompts(), []
    for _ in range(turns):
        replies = [o.outputs[0].token_ids for o in llm.generate(current, params, use_tqdm=False)]
        out += replies
        current = [p + r + [7] for p, r in zip(current, replies)]
    return out


# Granite (Mamba2, checkpoint stride 8: decode-time captures past rejected drafts) in the fast run; the
# other two families (about 4 s more on 2 cores) with the slow ones; tests/attention/test_state_rollback.py
# checks every layer kind's rollback in the fast run.
@pytest.fixture(scope="module", params=["granitemoehybrid", pytest.param("qwen3_next", marks=pytest.mark.slow),
                                        pytest.param("kimi_linear", marks=pytest.mark.slow)])
def family(request, tiny_model):
    """(an LLM without speculation, whose loaded model the others share; its greedy tokens over two turns)."""
    path, _ = tiny_model(request.param)
    plain = LLM(str(path), **BASE)
    return plain, run(plain, turns=2)


def replies_of(plain: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each prompt of both turns (as `run` builds them) -> its greedy reply."""
    first, n = prompts(), len(prompts())
    second = [p + r + [7] for p, r in zip(first, plain[:n])]
    return {tuple(p): r for p, r in zip(first + second, plain)}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_are_identical_with_partly_rejected_drafts(family, scenario, monkeypatch):
    plain_llm, plain = family
    monkeypatch.setattr(speculator_module, "make_proposer", lambda config: OracleProposer(replies_of(plain)))
    options = BASE | (small_cache(plain_llm) if scenario == "preemption" else SCENARIOS[scenario])
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=NGRAM, **options)
    turns = 2 if scenario == "caching" else 1
    assert run(llm, turns) == plain[:len(plain) * turns // 2]
    stats = llm.engine.stats().speculation
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts kept, some rolled back
    assert 0 < stats.accepted_per_position[0] < stats.drafted_per_position[0]
    if scenario == "caching" and llm.engine.core.kv_config.checkpoint_stride == 8:  # Granite's; 64 is past these
        assert llm.engine.core.scheduler.kv.prefix_cache_stats().checkpoint_restores > 0
    if scenario == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    llm.engine.core.scheduler.assert_idle()


class BoundaryProposer(OracleProposer):
    """Drafts the known greedy continuation, all of it wrong when the step it is verified in would
    cross a checkpoint boundary past its first row, all right otherwise."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]], stride: int):
        super().__init__(replies)
        self.stride = stride

    def propose(self, request_id, token_ids, max_tokens: int) -> list[int]:
        for prompt, reply in self.replies.items():
            done = len(token_ids) - len(prompt)
            if done >= 0 and tuple(token_ids[:len(prompt)]) == prompt and list(token_ids[len(prompt):]) == reply[:done]:
                truth = reply[done:done + max_tokens]
                n = len(token_ids)  # the step's rows end at positions n, ..., n + len(truth)
                if any(p % self.stride == 0 for p in range(n + 1, n + len(truth) + 1)):
                    return [(t + 1) % VOCAB for t in truth]
                return truth
        return []


def test_a_reply_verified_across_its_boundaries_keeps_its_last_checkpoint_for_the_next_turn(family, monkeypatch):
    """Every verification crossing a stride boundary rejects its drafts (the boundary's capture is
    dropped) and the others accept all of theirs (one finishes the reply past its last boundary): the
    next turn still restores the deepest boundary the reply computed, as without speculation."""
    plain_llm, plain = family
    stride = plain_llm.engine.core.kv_config.checkpoint_stride
    if stride != 8:
        pytest.skip("the replies reach no checkpoint boundary at a stride of 64")
    monkeypatch.setattr(speculator_module, "make_proposer",
                        lambda config: BoundaryProposer(replies_of(plain), stride))
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=NGRAM, **BASE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = prompts()
    assert [o.outputs[0].token_ids for o in llm.generate(first, params, use_tqdm=False)] == plain[:len(first)]
    second = [p + r + [7] for p, r in zip(first, plain)]
    hits = [o.num_cached_tokens for o in llm.generate(second, params, use_tqdm=False)]
    assert hits == [(len(p) + NEW_TOKENS - 1) // stride * stride for p in first]  # its last token is not computed
    stats = llm.engine.stats().speculation
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.core.scheduler.assert_idle()


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_tokens_are_identical_with_lookup_drafts(family, config):
    plain_llm, plain = family
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=config, **BASE)
    assert run(llm, 2) == plain
    assert llm.engine.stats().speculation.num_draft_tokens > 0
    llm.engine.core.scheduler.assert_idle()


def test_an_attention_draft_model_serves_a_hybrid_target(family, tmp_path):
    """A hybrid target with a small attention-only draft of its vocabulary: the random draft is mostly
    wrong, so most verifications roll the target's state back."""
    plain_llm, plain = family
    draft = tmp_path / "draft"
    save_random_model(LlamaConfig(**DRAFT_SIZES), draft, seed=5)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=spec, **BASE)
    assert run(llm) == plain[:len(prompts())]
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    llm.engine.core.scheduler.assert_idle()


DRAFT_BASE = BASE | dict(kv_cache_memory="24MiB")  # the draft's cache comes out of the same budget


@pytest.fixture(scope="module")
def hybrid_drafts(family, tiny_model, tmp_path_factory):
    """(the target's checkpoint, a random draft of its family and vocabulary seeded apart)."""
    name = family[0].engine.core.loaded.hf_config.model_type
    same, _ = tiny_model(name)
    other = tmp_path_factory.mktemp("other")
    (save_random_hybrid if name in MLA_CONFIGS else save_random_model)(
        (MLA_CONFIGS | STATE_CONFIGS)[name](), other, seed=5)
    return str(same), str(other)


def draft_spec(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3}


def test_a_hybrid_draft_equal_to_the_target_has_its_drafts_accepted(family, hybrid_drafts):
    """Each proposal chains drafts through the draft's state, which is put back to the state after the
    request's tokens, and the next proposal feeds the accepted drafts again from there: a slot left
    after its chained drafts (or put back to anything else) would feed them twice and spoil the drafts."""
    plain_llm, plain = family
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=draft_spec(hybrid_drafts[0]), **DRAFT_BASE)
    assert run(llm) == plain[:len(prompts())]
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(prompts())
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert llm.engine.core.scheduler.speculator.proposer.num_requests == 0
    llm.engine.core.scheduler.assert_idle()


@pytest.mark.parametrize("family", ["granitemoehybrid"], indirect=True)  # the others: the two tests around
@pytest.mark.parametrize("scenario", ["caching", "preemption"])
def test_a_hybrid_draft_model_keeps_the_greedy_tokens(family, hybrid_drafts, scenario):
    """A random hybrid draft: its drafts are rejected; the second turn hits the draft's own state
    checkpoints; a small cache preempts requests, which give their draft slots back."""
    plain_llm, plain = family
    options = DRAFT_BASE
    if scenario == "preemption":
        small = small_cache(plain_llm)
        options = BASE | small | dict(kv_cache_memory=2 * small["kv_cache_memory"])  # the draft's is as large
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=draft_spec(hybrid_drafts[1]), **options)
    proposer = llm.engine.core.scheduler.speculator.proposer
    turns = 2 if scenario == "caching" else 1
    assert run(llm, turns) == plain[:len(plain) * turns // 2]
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(prompts()) and stats.num_accepted_tokens < stats.num_draft_tokens
    if scenario == "caching" and llm.engine.core.kv_config.checkpoint_stride == 8:  # Granite's; 64 is past these
        assert proposer.kv.prefix_cache_stats().checkpoint_restores > 0
    if scenario == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert proposer.num_requests == 0 and proposer.kv.usage() == [0.0] * len(proposer.kv.config.groups)
    llm.engine.core.scheduler.assert_idle()


def test_a_hybrid_draft_s_state_after_a_rejection_is_that_of_a_draft_fed_the_kept_tokens(family, hybrid_drafts):
    """The target kept one of three drafts: the draft's next proposal, and its state slots after it, are
    those of a request fed the same tokens afresh (its prompt in one forward: the scan's other chunking
    leaves float rounding only), not of one whose state still holds the rejected draft."""
    plain_llm, _ = family
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=draft_spec(hybrid_drafts[1]),
              **DRAFT_BASE | dict(enable_prefix_caching=False))
    proposer = llm.engine.core.scheduler.speculator.proposer
    prompt = prompts()[2]
    first = proposer.propose("a", prompt, 3)
    kept = prompt + [first[0], (first[1] + 1) % VOCAB, 7, 8]
    again = proposer.propose("a", kept, 3)
    assert proposer.num_cached_rows("a") == len(kept)  # its tokens; the drafts were chained, then dropped
    assert proposer.propose("b", kept, 3) == again
    states = [c for c in proposer.runner.layer_caches.values() if isinstance(c, StateCache)]
    assert states
    for cache in states:
        slot_a, slot_b = (proposer.kv.block_ids(rid)[cache.group][0] for rid in "ab")
        for tensor in cache.tensors:
            torch.testing.assert_close(tensor[slot_a], tensor[slot_b], atol=1e-4, rtol=1e-4)
    proposer.forget("a")
    proposer.forget("b")
    assert proposer.num_requests == 0 and proposer.kv.usage() == [0.0] * len(proposer.kv.config.groups)


@pytest.mark.parametrize("family", ["granitemoehybrid"], indirect=True)
def test_a_hybrid_draft_s_failed_proposal_gives_its_slots_back(family, hybrid_drafts, monkeypatch):
    """A forward that fails mid-chain leaves the slot past the record's rows: the record is given up
    (nothing held), and the next proposal starts over, proposing what a fresh request does."""
    plain_llm, _ = family
    llm = LLM(plain_llm.engine.core.loaded, speculative_config=draft_spec(hybrid_drafts[1]),
              **DRAFT_BASE | dict(enable_prefix_caching=False))
    proposer = llm.engine.core.scheduler.speculator.proposer
    prompt = prompts()[2]
    execute, calls = proposer.runner.execute, []

    def failing(out):
        calls.append(out)
        if len(calls) == 2:  # the first chained draft
            raise RuntimeError("device lost")
        return execute(out)

    monkeypatch.setattr(proposer.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        proposer.propose("a", prompt, 3)
    assert proposer.num_cached_rows("a") == 0 and proposer.kv.usage() == [0.0] * len(proposer.kv.config.groups)
    assert proposer.propose("a", prompt, 3) == proposer.propose("b", prompt, 3)
    proposer.forget("a")
    proposer.forget("b")
    assert proposer.num_requests == 0
