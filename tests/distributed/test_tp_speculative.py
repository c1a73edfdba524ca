"""Speculative decoding over 2 gloo ranks: the proposer and the acceptance run on rank 0, the
verification's k + 1 rows through every rank's forward, and rank 1 takes the accepted count from
the scheduler's next step (worker/input_batch.py). Greedy tokens equal one rank's without
speculation, with drafts accepted (so rank 1 really settled verifications), with prefix caching,
chunked prefill, poison and the integrity checks on; under `-m tp_full` also under preemption, and
with a draft model (loaded whole on rank 0) equal to the target, and on a hybrid (Granite 4.0-H):
one rank's tokens with drafts partly rejected, rank 1 rolling its own state slots back once it learns
the accepted count, and with itself, hybrid, as its draft model; and with the checkpoint's
multi-token-prediction head (DeepSeek-V3 made to draft the target's own tokens, every draft accepted;
Qwen3-Next with a random head, every draft rejected), run whole on rank 0.

Each TP=2 engine spawns a rank process that imports torch and loads its shard (~5-10 s here):
the default suite runs one engine pair, `-m tp_full` the rest.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from blockserve.engine.llm import LLM
from blockserve.models.random_checkpoint import save_random_model
from blockserve.sampling_params import SamplingParams
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts
from tests.distributed.processes import child_pids
from tests.engine.test_speculative_engine import NEW_TOKENS, SPEC, prompts
from tests.engine.test_tiny_engine import SIZES
from tests.engine.test_hybrid_speculative import BASE as HYBRID
from tests.engine.test_hybrid_speculative import OracleProposer
from tests.engine.test_hybrid_speculative import prompts as hybrid_prompts
from tests.engine.test_hybrid_speculative import replies_of as hybrid_replies
from tests.engine.test_hybrid_speculative import run as hybrid_run
from tests.models.conftest import STATE_CONFIGS, state_model_prompts
from tests.models.mtp_checkpoint import make_self_predicting, save_with_mtp

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # rank processes

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
OPTIONS = dict(num_threads=1, block_size=4, check_integrity=True, poison=True, enable_prefix_caching=True,
               max_num_batched_tokens=16)  # the 30-token prompt in chunks
# Two KV heads over two ranks: a rank's block holds half the bytes, so half the budget gives each rank
# the blocks one device has with the whole of it (about 17: the preemption case runs out of them).
ROOMY, TIGHT = dict(kv_cache_memory="4MiB"), dict(kv_cache_memory=17 * 4096, max_model_len=64)
TIGHT_PER_RANK = dict(kv_cache_memory=17 * 2048, max_model_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified (rank 0's speculator weighs every step alike), whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def _run_tp2(path: str, spec: dict, plain: list[list[int]], **options):
    """Generate twice on a TP=2 engine with `spec`, the second time from the prefix cache (asserted
    hit): each time `plain`'s tokens. Returns the engine's SchedulerStats; no process is left."""
    before = child_pids()
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **OPTIONS, **options) as llm:
        assert _tokens(llm) == plain
        hits = llm.engine.stats().prefix_cache_hits
        assert _tokens(llm) == plain
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits > hits
        llm.engine.core.scheduler.assert_idle()
    assert not child_pids() - before  # closed: rank 1 has exited
    return stats


def test_tp2_ngram_speculation_gives_one_ranks_plain_tokens(tiny):
    with LLM(tiny, **OPTIONS, **ROOMY) as llm:
        plain = _tokens(llm)
    stats = _run_tp2(tiny, SPEC, plain, **ROOMY).speculation
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # rank 1 settled accepted drafts
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ...and rejected ones (random weights)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


@pytest.mark.tp_full
def test_tp2_speculation_under_preemption(tiny):
    with LLM(tiny, **OPTIONS, **TIGHT) as llm:
        plain = _tokens(llm)
    stats = _run_tp2(tiny, SPEC, plain, **TIGHT_PER_RANK)
    assert stats.num_preemptions > 0
    assert stats.speculation.num_accepted_tokens > 0


@pytest.mark.tp_full
def test_tp2_with_a_draft_model_on_rank_0(tiny):
    """The draft (here the target itself, loaded whole) runs on rank 0 only; its drafts are the target's
    greedy tokens, so nearly all are accepted."""
    with LLM(tiny, **OPTIONS, **ROOMY) as llm:
        plain = _tokens(llm)
    spec = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3}
    stats = _run_tp2(tiny, spec, plain, **ROOMY).speculation
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2


@pytest.mark.tp_full
def test_tp2_verifies_sampled_drafts_on_rank_0(tiny):
    """At temperature 0.8 the draft (the target itself) samples its drafts on rank 0 and hands their
    distributions to rank 0's verification, which accepts nearly all of them; seeded runs repeat (without
    prefix hits, which would change how the step's token budget splits into drafts: one draw per row)."""
    params = SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, seed=4, ignore_eos=True)
    spec = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 3}
    options = OPTIONS | ROOMY | {"enable_prefix_caching": False}
    with LLM(tiny, tensor_parallel_size=2, speculative_config=spec, **options) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)] == first
        stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(prompts())
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """(a tiny Granite 4.0-H: Mamba2 and attention layers, saved; its greedy tokens on one rank)."""
    path = tmp_path_factory.mktemp("granite")
    save_random_model(STATE_CONFIGS["granitemoehybrid"](), path)
    with LLM(str(path), num_threads=1, **HYBRID) as llm:
        return str(path), hybrid_run(llm)


# ~17 s on a busy 2-core machine; tests/attention/test_state_rollback.py's rank-1 cases run by default
@pytest.mark.tp_full
def test_tp2_hybrid_rolls_each_rank_s_state_back_to_its_accepted_drafts(granite, monkeypatch):
    """Drafts that are right for a varying number of tokens, then wrong: every verification keeps some
    and rolls back the rest. Rank 1 scores them without sampling; it keeps its rows' states until the
    request's next step says how many were kept, then rolls its own slots (its half of the heads) back:
    a slot left after a rejected draft would change its half of every later step, and the tokens."""
    path, plain = granite
    monkeypatch.setattr(speculator_module, "make_proposer", lambda config: OracleProposer(hybrid_replies(plain)))
    before = child_pids()
    with LLM(path, tensor_parallel_size=2, speculative_config=SPEC, num_threads=1, **HYBRID) as llm:
        assert hybrid_run(llm) == plain
        stats = llm.engine.stats().speculation
        llm.engine.core.scheduler.assert_idle()
    assert not child_pids() - before
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.tp_full
def test_tp2_hybrid_with_a_hybrid_draft_model_on_rank_0(granite):
    """The target as its own draft, loaded whole on rank 0, its state slots put back after each
    proposal's chained drafts: nearly all drafts are accepted, and the tokens are one rank's."""
    path, plain = granite
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, num_threads=1,
             **HYBRID | dict(kv_cache_memory="24MiB")) as llm:
        assert hybrid_run(llm) == plain
        stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens > 2 * len(hybrid_prompts())
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


@pytest.mark.tp_full
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_tp2_mtp_head_on_rank_0_gives_one_rank_s_tokens(tmp_path, family):
    """The MTP head runs whole on rank 0 from rank 0's (all-reduced) final hidden states: its drafts, and
    so the greedy tokens and the acceptance books, are one rank's, which are plain decoding's. The
    DeepSeek-V3 head predicts the target's own tokens (every draft accepted: rank 1 settles k + 1 tokens
    per verification); the random Qwen3-Next head's drafts are all rejected (rank 1 keeps one token)."""
    save_with_mtp(family, tmp_path)
    if family == "deepseek_v3":
        make_self_predicting(tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    options = dict(num_threads=1, block_size=4, max_model_len=128, kv_cache_memory="8MiB", check_integrity=True,
                   poison=True, enable_prefix_caching=True, max_num_batched_tokens=16)
    prompts = state_model_prompts(4)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    with LLM(str(tmp_path), **options) as llm:
        plain = run(llm)
    with LLM(str(tmp_path), speculative_config=spec, **options) as llm:
        assert run(llm) == plain
        one_rank = llm.engine.stats().speculation
    before = child_pids()
    with LLM(str(tmp_path), tensor_parallel_size=2, speculative_config=spec, **options) as llm:
        assert run(llm) == plain
        stats = llm.engine.stats().speculation
        proposer = llm.engine.core.scheduler.speculator.proposer
        assert proposer.runner.model.vocab is not None  # its own whole copies of the vocabulary tables
        assert proposer.num_requests == 0
        llm.engine.core.scheduler.assert_idle()
    assert not child_pids() - before
    assert (stats.drafted_per_position, stats.accepted_per_position) == \
        (one_rank.drafted_per_position, one_rank.accepted_per_position)
    assert stats.num_draft_tokens > 0
    if family == "deepseek_v3":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens == 0
