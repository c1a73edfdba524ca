"""SpeculativeConfig's refusals, the n-gram proposer, the acceptance rule and the speculator's books."""

from __future__ import annotations

import pytest

from blockserve.spec_decode.acceptance import num_accepted
from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.ngram import NgramProposer
from blockserve.spec_decode.speculator import FIRST_BACKOFF_STEPS, Speculator
from blockserve.spec_decode.step_costs import SMOOTHING, STALE_AFTER, FlatStepCosts, StepCosts


def test_the_json_shape_parses():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                                     '"prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 2, 4)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, field", [
    ('{"method": "eagle"}', "method"), ('{"method": "bogus"}', "method"), ('{"num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "model": "x"}', "model"), ('{"method": "ngram", "k": 2}', "k"), ("{not json", "JSON"),
    ('{"method": "ngram", "suffix_decoding_max_tree_depth": 8}', "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}', "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "suffix_decoding_max_cached_requests"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "suffix_decoding_max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob"),
    ('{"method": "draft_model"}', "model"), ('{"method": "draft_model", "model": ""}', "model"),
    ('{"method": "draft_model", "model": "d", "prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "mtp", "model": "d"}', "model"), ('{"method": "mtp", "prompt_lookup_min": 2}', "prompt_lookup_min"),
    ('{"method": "mtp", "suffix_decoding_min_token_prob": 0.5}', "suffix_decoding_min_token_prob"),
    ('{"method": "mtp", "num_speculative_tokens": 17}', "num_speculative_tokens"),
])
def test_bad_configs_are_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


def test_ngram_proposes_what_followed_the_latest_match_longest_first():
    proposer = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert proposer.propose("r", tokens, 3) == [4, 5, 7]  # "7 2 3" unseen; "2 3" last seen at 6..7
    tokens.append(4)
    assert proposer.propose("r", tokens, 2) == [5, 7]  # "2 3 4" seen at 6..8
    assert proposer.propose("s", [5, 6], 4) == []  # another request, no match
    assert proposer.num_requests == 2
    proposer.forget("r")
    assert proposer.num_requests == 1


def test_acceptance_keeps_the_agreeing_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert num_accepted([4, 5], [4, 5, 8]) == 2
    assert num_accepted([4], [3, 4]) == 0
    with pytest.raises(ValueError):
        num_accepted([4], [4])


def measured(speculator: Speculator, seconds_by_rows: dict[int, float]) -> Speculator:
    for rows, seconds in seconds_by_rows.items():
        speculator.observe_step(rows, seconds)
    return speculator


def test_step_costs_interpolate_and_leave_unmeasured_rows_free():
    costs = StepCosts()
    assert costs.seconds(1) is None and costs.best_drafts(4, 0.9, 1, 1) == 0  # the plain step is measured first
    costs.observe(1, 1.0)
    assert costs.best_drafts(4, 0.1, 1, 1) == 4  # larger steps never measured: tried
    costs.observe(5, 3.0)
    assert costs.seconds(3) == pytest.approx(2.0) and costs.seconds(6) is None
    costs.observe(5, 5.0)  # an average: the new observation weighs SMOOTHING
    assert costs.seconds(5) == pytest.approx(3.0 + SMOOTHING * 2.0)
    with pytest.raises(ValueError):
        costs.observe(0, 1.0)


@pytest.mark.parametrize("acceptance, expected", [(0.99, 3), (0.5, 2), (0.15, 0)])
def test_drafts_are_cut_where_their_rows_stop_paying(acceptance, expected):
    """Rows 2-4 cost a fifth of a step each, the fifth row a whole pass more (a 4-row kernel): near-certain
    drafts stop before the fifth row, coin flips where a row's tokens fall below its cost, rare ones
    take none."""
    costs = StepCosts()
    for rows, seconds in {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 3.2}.items():
        costs.observe(rows, seconds)
    assert costs.best_drafts(4, acceptance, 1, 1) == expected


HALF_STEP_ROWS = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0}  # each row past the first: half a plain step


def test_a_request_whose_drafts_do_not_pay_pauses_then_probes():
    speculator = measured(Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                                       prompt_lookup_max=1)), HALF_STEP_ROWS)
    tokens = [1, 2, 1, 2, 1]

    def step():
        speculator.begin_step()
        return speculator.propose("r", tokens, 4, 1)

    assert step() == []  # a draft row costs half a step: not worth it at the prior's acceptance of 0.5
    assert all(step() == [] for _ in range(FIRST_BACKOFF_STEPS - 2))
    assert step() == [2]  # the probe (one draft), after FIRST_BACKOFF_STEPS declines
    assert all(step() == [] for _ in range(2 * FIRST_BACKOFF_STEPS - 1))
    assert step() == [2]  # the next probe waits twice as long
    assert speculator.stats().num_skipped == 3 * FIRST_BACKOFF_STEPS - 2
    speculator.record("r", 1, 1)
    assert speculator.stats().per_position_acceptance == (1.0, 0.0, 0.0, 0.0)
    assert speculator.stats().mean_accepted_length == 2
    speculator.forget("r")
    assert speculator.num_requests == 0


def test_acceptance_and_the_step_so_far_decide_the_drafts():
    """Cheap rows up to 3, dear after: a request with high acceptance drafts, and a second request in
    the same step finds the cheap rows taken."""
    speculator = measured(Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                                       prompt_lookup_max=1)), {2: 1.0, 3: 1.1, 4: 1.2, 5: 3.0, 6: 5.0})
    tokens = [1, 2, 1, 2, 1]
    for _ in range(3):
        speculator.record("a", 2, 2)  # accepted every time
        speculator.record("b", 2, 2)
    speculator.begin_step()
    assert speculator.propose("a", tokens, 4, 2) == [2, 1]
    assert speculator.propose("b", tokens, 4, 2) == []  # rows 5 and 6 cost more than they add
    speculator.begin_step()
    assert speculator.propose("b", tokens, 4, 2) == [2, 1]


def test_large_batches_do_not_speculate():
    speculator = Speculator(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=8),
                            costs=FlatStepCosts())
    assert speculator.propose("r", [1, 2, 1], 4, 8) == []
    assert speculator.propose("r", [1, 2, 1], 4, 7) == [2, 1]


class CountingDraftModel:
    """A proposer whose every draft costs work (always_proposes): records what it was asked for."""

    always_proposes = True

    def __init__(self):
        self.asked: list[int] = []

    def propose(self, request_id, token_ids, max_tokens):
        self.asked.append(max_tokens)
        return [token_ids[-1]] * max_tokens

    def forget(self, request_id):
        pass

    num_requests = 0


def test_a_proposer_whose_drafts_cost_work_is_asked_only_for_drafts_that_pay():
    proposer = CountingDraftModel()
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)
    speculator = measured(Speculator(config, proposer), {1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0, 5: 5.0})
    for _ in range(3):
        speculator.record("r", 4, 4)  # accepted every time
    speculator.begin_step()
    assert speculator.propose("r", [5, 6], 4, 1) == [6, 6]  # rows 4 and 5 cost more than they add
    assert proposer.asked == [2]
    never = measured(Speculator(config, proposer), HALF_STEP_ROWS)
    assert all(never.propose("s", [5, 6], 4, 1) == [] for _ in range(FIRST_BACKOFF_STEPS - 1))
    assert proposer.asked == [2]  # declined steps run no draft forward
    assert never.propose("s", [5, 6], 4, 1) == [6]  # the probe asks for one
    assert proposer.asked == [2, 1]


def test_no_probe_where_not_even_certain_drafts_would_pay():
    """A draft row as costly as a plain step (a draft model as large as the target, whose forwards the
    steps' seconds include): however sure its drafts, a probe could show nothing, so none is drafted
    until the costs are measured again."""
    proposer = CountingDraftModel()
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)
    speculator = measured(Speculator(config, proposer), {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0})
    for _ in range(3):
        speculator.record("r", 4, 4)  # accepted every time
    assert all(speculator.propose("r", [5, 6], 4, 1) == [] for _ in range(4 * FIRST_BACKOFF_STEPS))
    assert proposer.asked == []
    for _ in range(STALE_AFTER + 1):
        speculator.observe_step(1, 1.0)  # the draft rows' costs go stale: unmeasured, they are tried again
    assert speculator.propose("r", [5, 6], 4, 1) == [6] * 4 and proposer.asked == [4]


class BatchedDraftModel(CountingDraftModel):
    def propose_batch(self, asks):
        self.asked.append([(rid, n) for rid, _, n in asks])
        return {rid: [tokens[-1]] * n for rid, tokens, n in asks}


def test_a_batched_proposer_drafts_once_per_step_for_every_request():
    proposer = BatchedDraftModel()
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
    speculator = Speculator(config, proposer, FlatStepCosts())
    assert speculator.batches
    speculator.begin_step()
    speculator.prepare_step([("a", [1, 2], 3), ("b", [4, 5], 2)], 2)
    assert proposer.asked == [[("a", 3), ("b", 2)]]
    assert speculator.propose("b", [4, 5], 1, 2) == [5]  # cut to the room the step has left
    assert speculator.propose("a", [1, 2], 3, 2) == [2, 2, 2]
    assert speculator.propose("c", [7], 3, 2) == []  # not among the step's candidates
    assert proposer.asked == [[("a", 3), ("b", 2)]]


class ScriptedProposer:
    """Proposes `drafts` whenever asked (cut to max_tokens) and counts the steps it was asked for
    drafts in (asked for none, it only follows the request)."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts
        self.asked_at: list[int] = []
        self.step = 0

    def propose(self, request_id, token_ids, max_tokens):
        if max_tokens > 0:
            self.asked_at.append(self.step)
        return self.drafts[:max_tokens]

    def forget(self, request_id):
        pass

    num_requests = 0


BATCH_16_COSTS = {16: 1.0, 17: 1.002, 32: 1.05, 48: 1.15, 80: 1.4}  # draft rows nearly free: a wide batch


def run_steps(speculator: Speculator, proposer: ScriptedProposer, steps: int, accepted) -> list[int]:
    """`steps` steps of request "r" in a batch of 16, the target accepting accepted(step, drafts) of
    its drafts; the number of drafts verified each step."""
    verified = []
    for step in range(steps):
        proposer.step = step
        speculator.begin_step()
        drafts = speculator.propose("r", [1, 2, 3], 4, 16)
        if drafts:
            speculator.record("r", len(drafts), accepted(step, drafts))
        verified.append(len(drafts))
    return verified


def test_a_proposer_that_is_always_wrong_stops_being_asked_and_is_probed_later():
    """Even where draft rows cost next to nothing, drafts that never match stop within a few steps
    (the proposer is asked for none: no drafting time), then one-draft probes come at doubling
    intervals."""
    proposer = ScriptedProposer([9, 9, 9, 9])
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    speculator = measured(Speculator(config, proposer), BATCH_16_COSTS)
    verified = run_steps(speculator, proposer, 300, lambda step, drafts: 0)
    drafting = [step for step, n in enumerate(verified) if n]
    assert drafting[:5] == [0, 1, 2, 3, 4]  # the prior forgotten: below MIN_ACCEPTANCE after five misses
    assert proposer.asked_at == drafting  # declined steps ask the proposer for no drafts
    probes = drafting[5:]
    assert probes == [8, 16, 32, 64, 128, 256] and all(verified[step] == 1 for step in probes)  # back-off doubles
    assert speculator.stats().num_skipped == 300 - len(drafting)


def test_a_good_proposer_keeps_drafting():
    proposer = ScriptedProposer([1, 2, 3, 4])
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    speculator = measured(Speculator(config, proposer), BATCH_16_COSTS)
    verified = run_steps(speculator, proposer, 100, lambda step, drafts: len(drafts))
    assert verified == [4] * 100 and speculator.stats().num_skipped == 0


def test_a_request_whose_drafts_start_to_match_drafts_again_after_a_probe():
    proposer = ScriptedProposer([1, 2, 3, 4])
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    speculator = measured(Speculator(config, proposer), BATCH_16_COSTS)
    verified = run_steps(speculator, proposer, 200, lambda step, drafts: 0 if step < 100 else len(drafts))
    assert not any(verified[20:100]) or max(verified[20:100]) == 1  # probes only while the drafts miss
    back = [step for step in range(100, 200) if verified[step] == 4]
    assert back and back == list(range(back[0], 200))  # the first accepted probe, and from then on all four
