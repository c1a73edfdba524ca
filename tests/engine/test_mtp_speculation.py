"""Multi-token-prediction speculation (method "mtp") on tiny random DeepSeek-V3 and Qwen3-Next checkpoints
whose safetensors carry an MTP layer named as the released checkpoints name it
(tests/models/mtp_checkpoint.py):

- greedy tokens identical to a run without speculation (prefix caching on, with the second run's
  prompts from the cache, and off; chunked prefill; async scheduling; preemption), the acceptance
  books in stats(), and nothing held afterwards;
- the head's drafts (k of them, chained) and their logits equal an independent torch reference of
  the MTP layer computed from the raw weights, given the target's hidden states;
- after a verification that rejected drafts, the head feeds only the target's states of the tokens
  kept and proposes what a head fed them from scratch proposes;
- a head made to compute the target's own token after next has every draft accepted;
- a tensor-parallel target's head is loaded whole, with its own copies of the vocabulary tables, and
  computes the one-device head's logits calling no collective (rank 0 runs it alone; the TP=2 engines
  are tests/distributed/test_tp_speculative.py's);
- a family without MTP layers, a DeepSeek-V3 config with num_nextn_predict_layers 0, and checkpoints
  without the layer's weights are refused at start-up, naming what is missing."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.config_args import config_from_namespace
from blockserve.engine.config import EngineConfig
from blockserve.models.loader import load_model
from blockserve.models.mtp import load_mtp
from blockserve.models.placement import Placement
from blockserve.models.random_checkpoint import save_random_model
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.worker import mtp_proposer
from tests.engine.test_config_args import engine_parser
from tests.engine.test_hybrid_speculative import small_cache
from tests.engine.test_tiny_engine import SIZES
from tests.models.conftest import MLA_CONFIGS, STATE_CONFIGS, VOCAB, state_model_prompts
from tests.models.mtp_checkpoint import make_self_predicting, save_with_mtp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["deepseek_v3", "qwen3_next"]
OPTIONS = dict(block_size=4, max_model_len=128, kv_cache_memory="8MiB", check_integrity=True, poison=True)
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
K = 3


def mtp(k: int = K) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (path, MTPReference), built on first use."""
    built = {}

    def get(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(f"{family}-mtp")
            built[family] = str(path), save_with_mtp(family, path)
        return built[family]

    return get


@pytest.fixture(autouse=True)
def flat_step_costs(monkeypatch):
    """Every draft is verified, whatever the machine's load."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_nothing_held(llm: LLM) -> None:
    proposer = llm.engine.core.scheduler.speculator.proposer
    assert proposer.num_requests == 0
    assert proposer.kv.usage() == [0.0] * len(proposer.kv.config.groups)
    assert not proposer.runner.batch.requests
    llm.engine.core.scheduler.assert_idle()  # the head's KV manager included: idle, nothing pending


SCENARIOS = {
    "caching": {},
    "no-caching": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},
    "async": {"async_scheduling": True},  # the target's states recorded at launch, drafts after the step settles
}


@pytest.mark.parametrize("family, scenario", [  # DeepSeek-V3 with prefix hits by default: the accepted-drafts test
    ("qwen3_next", "chunked"),
    *(pytest.param(f, s, marks=pytest.mark.slow) for f in FAMILIES for s in SCENARIOS
      if (f, s) != ("qwen3_next", "chunked"))])
def test_greedy_tokens_are_those_of_plain_decoding(checkpoints, family, scenario):
    path, _ = checkpoints(family)
    options = OPTIONS | SCENARIOS[scenario]
    prompts = state_model_prompts(6)
    plain = tokens(LLM(path, **options), prompts)
    llm = LLM(path, speculative_config=mtp(), **options)
    assert tokens(llm, prompts) == plain
    if scenario == "caching":  # the prompts again, from the target's prefix cache: the head starts past the hit
        assert tokens(llm, prompts) == plain
    stats = llm.engine.stats().speculation
    assert stats.num_verifications > 0 and stats.num_draft_tokens > stats.num_verifications  # chained drafts
    assert len(stats.drafted_per_position) == K and stats.drafted_per_position[K - 1] > 0
    assert stats.num_draft_tokens == sum(stats.drafted_per_position)
    assert stats.num_accepted_tokens == sum(stats.accepted_per_position) <= stats.num_draft_tokens
    assert_nothing_held(llm)


def test_prompts_past_the_held_states_cap_keep_their_greedy_tokens_and_get_drafts(checkpoints, monkeypatch):
    """A prompt longer than the states held per request: its head restarts from the latest states held
    (its first drafts attend those positions only), and what is held stays within the cap."""
    monkeypatch.setattr(mtp_proposer, "MAX_HELD_STATES", 4)
    path, _ = checkpoints("qwen3_next")
    prompts = [p for p in state_model_prompts(6) if len(p) > 4][:3]
    assert prompts
    plain = tokens(LLM(path, **OPTIONS), prompts)
    llm = LLM(path, speculative_config=mtp(), **OPTIONS)
    proposer = llm.engine.core.scheduler.speculator.proposer
    assert proposer.states.max_rows == 4
    assert tokens(llm, prompts) == plain
    assert llm.engine.stats().speculation.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_an_aborted_request_leaves_nothing_in_the_head_s_cache_not_even_pending_orders(checkpoints):
    """The head's blocks freed at an abort or a finish are poisoned at once (C2): nothing is pending for
    its runner once every request is done."""
    path, _ = checkpoints("qwen3_next")
    llm = LLM(path, speculative_config=mtp(), **OPTIONS)
    engine = llm.engine
    prompts = state_model_prompts(3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    proposer = engine.core.scheduler.speculator.proposer
    while proposer.num_cached_rows("1") == 0:
        engine.step()
    stats = engine.stats()  # the head's blocks are reported apart from the target's
    assert stats.proposer_kv_usage == proposer.kv.usage() and max(stats.proposer_kv_usage) > 0
    assert stats.kv_usage == engine.core.kv.usage() and len(stats.kv_usage) == len(engine.core.kv.config.groups)
    engine.abort_request(["1"])
    assert proposer.kv.pending_is_empty()
    while engine.has_unfinished_requests():
        engine.step()
    assert proposer.kv.pending_is_empty()
    assert_nothing_held(llm)
    assert engine.stats().proposer_kv_usage == [0.0] * len(proposer.kv.config.groups)


def test_close_drops_every_target_state_and_the_target_runner_s_hook(checkpoints):
    """Closing mid-run: the target states of a request that has not proposed yet (its prompt half
    prefilled) go too, and the target's runner no longer hands its states to the proposer."""
    path, _ = checkpoints("qwen3_next")
    llm = LLM(path, speculative_config=mtp(), **OPTIONS | {"max_num_batched_tokens": 4})
    engine = llm.engine
    engine.add_request("0", state_model_prompts(1)[0], GREEDY)
    engine.step()
    proposer, runner = engine.core.scheduler.speculator.proposer, engine.core.runner
    assert proposer.states.first("0") is not None and proposer.num_cached_rows("0") == 0
    assert runner.hidden_outputs == proposer.record
    engine.close()
    assert proposer.num_requests == 0 and len(proposer.states) == 0
    assert runner.hidden_outputs is None


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_requests_keep_their_greedy_tokens(checkpoints, family):
    path, _ = checkpoints(family)
    options = OPTIONS | small_cache(LLM(path, **OPTIONS))
    prompts = state_model_prompts(8)
    plain = tokens(LLM(path, **options), prompts)
    llm = LLM(path, speculative_config=mtp(), **options)
    assert tokens(llm, prompts) == plain
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_nothing_held(llm)


def test_a_head_that_drafts_the_target_s_own_tokens_has_them_accepted(tmp_path):
    """A DeepSeek-V3 checkpoint whose MTP layer computes the target's token after next (see
    make_self_predicting): every draft is accepted, at every position, through verifications that
    re-feed the head the target's states of the drafts it kept, the second time with the prompts from
    the target's prefix cache (the head starts past the hit), and the tokens are plain decoding's."""
    save_with_mtp("deepseek_v3", tmp_path)
    make_self_predicting(tmp_path)
    prompts = state_model_prompts(6)
    plain = tokens(LLM(str(tmp_path), **OPTIONS), prompts)
    llm = LLM(str(tmp_path), speculative_config=mtp(), **OPTIONS)
    assert tokens(llm, prompts) == plain
    assert tokens(llm, prompts) == plain
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens >= len(prompts) * (NEW_TOKENS // (K + 1))
    assert stats.accepted_per_position == stats.drafted_per_position  # every draft, every position
    assert stats.mean_accepted_length > K  # most verifications emit K + 1 tokens
    assert_nothing_held(llm)


def test_sampled_drafts_of_a_head_that_predicts_the_target_are_accepted(tmp_path):
    """At temperature 0.8 the self-predicting head samples its drafts from the target's own distribution
    of the token after next, so rejection sampling accepts nearly all of them (comparing with the
    target's own sample would accept about sum p^2); seeded runs repeat."""
    save_with_mtp("deepseek_v3", tmp_path)
    make_self_predicting(tmp_path)
    prompts = state_model_prompts(2)
    llm = LLM(str(tmp_path), speculative_config=mtp(), **OPTIONS)
    params = SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, seed=2, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens >= len(prompts) * (NEW_TOKENS // (K + 1))
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert_nothing_held(llm)


def head_logits(proposer) -> list[torch.Tensor]:
    """Every logits row the head computes from now on, in order."""
    seen = []
    head = proposer.runner.model
    compute = head.compute_logits
    head.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafts_are_the_mtp_layer_s_as_an_independent_reference_computes_them(checkpoints, family):
    """From the target's states of a prompt, k chained drafts and their logits as a torch reference of
    the layer (norms, [embedding | hidden] projection, transformers' decoder block, the head) gives."""
    path, reference = checkpoints(family)
    proposer = LLM(path, speculative_config=mtp(), **OPTIONS).engine.core.scheduler.speculator.proposer
    seen = head_logits(proposer)
    token_ids = state_model_prompts(8)[5] + [17]
    states = reference.target_states(token_ids[:-1])
    proposer.record(["a"], [0, len(states)], [0], states)
    drafts = proposer.propose("a", token_ids, K)
    want, want_logits = reference.drafts(token_ids, K)
    assert drafts == want
    for got, expected in zip(seen, want_logits, strict=True):
        torch.testing.assert_close(got[-1], expected, atol=1e-4, rtol=1e-4)
    assert proposer.num_cached_rows("a") == len(token_ids) - 1  # the chained rows are not kept
    proposer.forget("a")
    assert proposer.num_requests == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_after_a_rejection_the_head_proposes_what_a_fresh_one_fed_the_kept_tokens_does(checkpoints, family):
    """A verification of [t, d1, d2, d3] that kept d1 and not d2: its rows for d2 and d3 (whatever the
    target computed there) are replaced by the next step's, and the head's next drafts and logits are
    those of a head fed every kept token's state from scratch; then one that kept no draft."""
    path, reference = checkpoints(family)
    proposer = LLM(path, speculative_config=mtp(), **OPTIONS).engine.core.scheduler.speculator.proposer
    seen = head_logits(proposer)
    token_ids = state_model_prompts(8)[7] + [17]
    proposer.record(["a"], [0, len(token_ids) - 1], [0], reference.target_states(token_ids[:-1]))
    drafts = proposer.propose("a", token_ids, K)
    for accepted in (1, 0):
        n = len(token_ids)
        kept = drafts[:accepted] + [(drafts[accepted] + 1) % VOCAB]  # the accepted drafts, then the target's token
        valid = reference.target_states(token_ids + kept[:-1])[n - 1:]  # rows of t and the accepted drafts
        rows = torch.cat([valid, torch.randn(K + 1 - len(valid), valid.shape[1])])  # rejected rows: never read
        proposer.record(["a"], [0, K + 1], [n - 1], rows)
        token_ids = token_ids + kept
        seen.clear()
        drafts = proposer.propose("a", token_ids, K)
        got = [logits[-1] for logits in seen]
        assert proposer.num_cached_rows("a") == len(token_ids) - 1
        seen.clear()
        proposer.record(["b"], [0, len(token_ids) - 1], [0], reference.target_states(token_ids[:-1]))
        assert proposer.propose("b", token_ids, K) == drafts
        proposer.forget("b")
        for logits, fresh in zip(got, seen, strict=True):
            torch.testing.assert_close(logits, fresh[-1], atol=1e-4, rtol=1e-4)
    proposer.forget("a")
    assert proposer.num_requests == 0


def test_a_family_without_mtp_layers_is_refused(tmp_path):
    save_random_model(LlamaConfig(**SIZES), tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no multi-token-prediction layers"):
        LLM(str(tmp_path), speculative_config=mtp(), **OPTIONS)


def test_a_deepseek_config_without_nextn_layers_is_refused(tmp_path):
    config = MLA_CONFIGS["deepseek_v3"]()
    config.num_nextn_predict_layers = 0
    save_random_model(config, tmp_path)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        LLM(str(tmp_path), speculative_config=mtp(), **OPTIONS)


@pytest.mark.parametrize("family, missing", [("deepseek_v3", r"model\.layers\.3\.\*"), ("qwen3_next", r"mtp\.\*")])
def test_a_checkpoint_without_the_mtp_weights_is_refused(tmp_path, family, missing):
    """The config declares the layer (DeepSeek-V3's default num_nextn_predict_layers is 1), the safetensors
    do not hold it; without speculation the same checkpoint serves."""
    save_random_model((MLA_CONFIGS | STATE_CONFIGS)[family](), tmp_path)
    with pytest.raises(ValueError, match=f"has no {missing} weights"):
        LLM(str(tmp_path), speculative_config=mtp(), **OPTIONS)


def test_the_command_line_takes_mtp_with_tensor_parallelism():
    args = engine_parser().parse_args(["--model", "m", "--speculative-config", json.dumps(mtp(2)),
                                       "--tensor-parallel-size", "2"])
    config = config_from_namespace(EngineConfig, args)
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("mtp", 2)
    assert config.tensor_parallel_size == 2


@pytest.fixture
def one_rank_group():
    """A tensor-parallel group of one rank: a target loaded on it is built of the vocab-parallel and
    sharded layers, whose collectives are real (gloo) calls."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = TensorParallelGroup(f"tcp://127.0.0.1:{port}", 0, 1)
    yield group
    group.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tensor_parallel_target_s_head_runs_whole_and_joins_no_collective(checkpoints, family, one_rank_group,
                                                                            monkeypatch):
    """Under tensor parallelism rank 0 alone runs the head: its layer is loaded unsharded (the weights of
    the one-device head), and its embedding and logits are those of the one-device head without calling
    any collective of the target's group (which the other ranks would never join: rank 0 would hang)."""
    path, reference = checkpoints(family)
    backend = BACKENDS[EngineConfig(model=path).attention_backend]
    sharded = load_model(path, backend, placement=Placement(tp=one_rank_group)).model
    whole = load_mtp(load_model(path, backend).model, path)
    head = load_mtp(sharded, path)
    assert head.vocab is not None and whole.vocab is None
    assert not [name for name, module in head.named_modules() if getattr(module, "tp", None) is not None]  # whole
    want = whole.layer.state_dict()
    assert head.layer.state_dict().keys() == want.keys()
    for name, tensor in head.layer.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    hidden = reference.target_states(state_model_prompts(2)[1])
    with torch.no_grad():
        want_logits = whole.compute_logits(hidden)
        want_embedding = whole.target.model.embed_tokens(torch.arange(VOCAB))
    for collective in ("all_reduce", "gather_to_first", "broadcast_object", "gather_objects", "barrier"):
        monkeypatch.setattr(one_rank_group, collective, lambda *a, name=collective, **k: pytest.fail(f"{name} called"))
    with torch.no_grad():
        torch.testing.assert_close(head.compute_logits(hidden), want_logits)
        torch.testing.assert_close(head.vocab.model.embed_tokens(torch.arange(VOCAB)), want_embedding)
