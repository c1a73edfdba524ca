"""The batched sampler: greedy, filters, penalties, per-request seeds, logprobs, and errors."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from blockserve.native.extension import fused_ops, quantized_matmul_ops, why_not_native
from blockserve.sampling_params import SamplingParams
from blockserve.worker.sampler import Sampler, _inverse_cdf, _min_p, _top_k, _top_p
from blockserve.worker.sampling_batch import GREEDY_TEMPERATURE, SamplingBatch, SamplingRow, make_generator

CPU = torch.device("cpu")
# The sampled rows' two implementations: csrc/sample.cpp (the CPU's, where it builds) and PyTorch's.
PATHS = [pytest.param(True, id="native",
                      marks=pytest.mark.skipif(why_not_native() is not None, reason=f"no native kernels: {why_not_native()}")),
         pytest.param(False, id="torch")]


def row(prompt=(), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sample(logits, rows, seed=0, native=True):
    sampler = Sampler(device=CPU, seed=seed)
    if not native:
        sampler.native = None
    return sampler(logits, SamplingBatch.build(rows, CPU))


def full_logprobs(out_row, vocab_size):
    """A row's whole log-distribution, read back from its top-n logprobs (needs n >= vocab_size)."""
    lp = torch.full((vocab_size,), float("nan"))
    lp[out_row.top_ids] = torch.tensor(out_row.top_logprobs)
    return lp


# -- greedy ----------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_whatever_else_is_in_the_batch():
    logits = randn(8, 1000)
    rows = [row(temperature=0) if i % 2 == 0 else row(temperature=1.0, top_k=5) for i in range(8)]
    tokens = sample(logits, rows).token_ids
    assert tokens[::2] == logits.argmax(dim=-1)[::2].tolist()
    assert sample(logits, [row(temperature=0)] * 8).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_breaks_ties_towards_the_lowest_id_like_torch_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    assert sample(logits, [row(temperature=0)] * 2).token_ids == [1, 0]


def test_greedy_is_argmax_of_the_penalised_logits():
    logits = torch.tensor([[4.0, 3.9, 1.0]])
    assert sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=1.5)]).token_ids == [1]
    assert sample(logits, [row(temperature=0, output=[0], presence_penalty=0.2)]).token_ids == [1]


# -- temperature -> 0 ------------------------------------------------------------------------------


def test_temperatures_below_the_greedy_threshold_are_greedy_and_draw_nothing():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5]])
    generator = make_generator(3, CPU)
    state = generator.get_state()
    for t in (0.0, GREEDY_TEMPERATURE / 2):
        assert sample(logits, [row(temperature=t, seed=3, generator=generator)]).token_ids == [1]
    assert torch.equal(generator.get_state(), state), "a greedy row consumed random numbers"


@pytest.mark.parametrize("native", PATHS)
def test_small_temperatures_concentrate_on_the_argmax_and_large_ones_spread(native):
    logits = randn(1, 50, seed=1).repeat(2000, 1)
    best = int(logits[0].argmax())
    share = {}
    for t in (1e-3, 0.05, 1.0, 5.0):
        tokens = sample(logits, [row(temperature=t)] * 2000, native=native).token_ids
        share[t] = tokens.count(best) / len(tokens)
    assert share[1e-3] == 1.0  # the runner-up is 0.136 below: odds of e^-136 per draw
    assert share[1e-3] >= share[0.05] >= share[1.0] >= share[5.0]
    assert share[5.0] < 0.2


@pytest.mark.parametrize("native", PATHS)
def test_equal_maxima_share_the_draws_at_a_low_temperature(native):
    logits = torch.tensor([[9.0, 0.0, 9.0, 8.0]]).repeat(4000, 1)
    tokens = sample(logits, [row(temperature=0.05)] * 4000, native=native).token_ids
    assert set(tokens) == {0, 2}
    assert 0.45 < tokens.count(0) / len(tokens) < 0.55


# -- the draws follow the filtered distribution ----------------------------------------------------


@pytest.mark.parametrize("native", PATHS)
def test_sample_frequencies_match_the_tempered_softmax(native):
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    n = 40000
    tokens = torch.tensor(sample(logits.repeat(n, 1), [row(temperature=0.7)] * n, native=native).token_ids)
    observed = torch.bincount(tokens, minlength=5) / n
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(observed, expected, atol=0.01), (observed, expected)


@pytest.mark.parametrize("native", PATHS)
def test_top_k_then_top_p_renormalise_like_hf(native):
    """top_p applies to the distribution left by top_k: with k=2 and probabilities .5/.3 left
    renormalised to .625/.375, top_p=0.6 keeps only the first."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0).repeat(500, 1)
    tokens = sample(logits, [row(top_k=2, top_p=0.6)] * 500, native=native).token_ids
    assert set(tokens) == {0}
    tokens = sample(logits, [row(top_k=2, top_p=0.7)] * 500, native=native).token_ids
    assert set(tokens) == {0, 1}


def test_filters_keep_the_same_tokens_as_the_hf_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 300, generator=g) * 3
    ids = torch.zeros((64, 1), dtype=torch.long)
    for k in (1, 7, 300):
        ours = _top_k(z.clone(), torch.full((64,), k), k)
        assert torch.equal(ours.isinf(), TopKLogitsWarper(k)(ids, z.clone()).isinf()), k
    for p in (0.05, 0.5, 0.9):
        ours = _top_p(z.clone(), torch.full((64,), p))
        assert torch.equal(ours.isinf(), TopPLogitsWarper(p)(ids, z.clone()).isinf()), p
    for m in (0.01, 0.2, 0.9):
        ours = _min_p(z.clone(), torch.full((64,), m))
        assert torch.equal(ours.isinf(), MinPLogitsWarper(m)(ids, z.clone()).isinf()), m


def excluded(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tokens the filters must drop, computed in float64 with a margin so that float32 rounding at
    a boundary (or a tie) never counts as an error."""
    z = logits.double() / p.temperature
    out = torch.zeros_like(z, dtype=torch.bool)
    if p.top_k > 0:
        kth = z.sort(descending=True).values[min(p.top_k, len(z)) - 1]
        out |= z < kth - 1e-3
    if p.top_p < 1:
        kept = torch.where(out, float("-inf"), z)
        probs = torch.softmax(kept, dim=-1)
        ahead = (probs * (kept > kept.unsqueeze(1) + 1e-3)).sum(dim=1)  # mass of the clearly more likely
        out |= ahead >= p.top_p + 1e-4
    if p.min_p > 0:
        out |= z < z.max() + math.log(p.min_p) - 1e-3
    return out


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.1, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 3, 5, 50]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 0.01]),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_filters_never_emit_an_excluded_token(values, temperature, top_k, top_p, min_p, seed):
    logits = torch.tensor(values)
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    seeded = [row(**params, seed=seed + i, generator=make_generator(seed + i, CPU)) for i in range(30)]
    rows = [row(**params)] * 270 + seeded
    banned = excluded(logits, SamplingParams(**params))
    assert not banned.all()
    for native in (True, False) if why_not_native() is None else (False,):
        tokens = sample(logits.repeat(len(rows), 1), rows, seed=seed, native=native).token_ids
        hits = [t for t in tokens if banned[t]]
        assert not hits, f"{'native' if native else 'torch'}: emitted excluded tokens {sorted(set(hits))}"


def reference_intervals(logits, temperature, top_k, top_p, min_p):
    """Each token's share [lower, upper) of [0, 1) in the draw, in float64: the softmax of z over
    the tokens the filters keep, laid out in id order; and which tokens are kept."""
    z = logits.double() / temperature
    keep = torch.isfinite(z)
    if 0 < top_k < len(z):
        keep &= z >= z.sort(descending=True).values[top_k - 1]
    if top_p < 1:
        ranked, order = torch.where(keep, z, -math.inf).sort(descending=True)
        probs = torch.softmax(ranked, dim=-1)
        keep &= z >= ranked[(probs.cumsum(0) - probs) < top_p].min()  # the mass ranked above < top_p
    if min_p > 0:
        keep &= z >= z.max() + math.log(min_p)
    probs = torch.softmax(torch.where(keep, z, -math.inf), dim=-1)
    upper = probs.cumsum(0)
    return upper - probs, upper, keep


def draw_with(build, logits, temperature, top_k, top_p, min_p, uniforms):
    """The sampled rows' draw for fixed uniforms: csrc/sample.cpp's (the native or the AVX2 build)
    or the PyTorch path's."""
    rows = len(uniforms)
    per_row = lambda value, dtype: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    if build != "torch":
        ops = fused_ops() if build == "native" else quantized_matmul_ops(without_avx512=True)
        return ops.sample_rows(logits, per_row(temperature, torch.float32), per_row(top_k, torch.long) if top_k else None,
                               per_row(top_p, torch.float32) if top_p < 1 else None,
                               per_row(min_p, torch.float32) if min_p else None, uniforms)
    z = logits / temperature
    if top_k:
        z = _top_k(z, per_row(top_k, torch.long), top_k)
    if top_p < 1:
        z = _top_p(z, per_row(top_p, torch.float32))
    if min_p:
        z = _min_p(z, per_row(min_p, torch.float32))
    return _inverse_cdf(z, uniforms)


BUILDS = [*(pytest.param(b, marks=pytest.mark.skipif(why_not_native() is not None, reason="no native kernels"))
            for b in ("native", "avx2")), "torch"]


@pytest.mark.parametrize("build", BUILDS)
def test_each_kept_token_is_drawn_where_its_interval_holds_u(build):
    """u in the middle of a kept token's interval draws that token, u = 0 the first kept token and
    u just below 1 the last: the filters keep the tokens the float64 reference keeps, and the draw
    is the inverse CDF over them (intervals wider than 1e-5, where float32 rounding cannot move u
    across a boundary)."""
    gen = torch.Generator().manual_seed(11)
    # Top-p's nucleus wide (4.0, 0.9: past the kernel's first 256 candidates) and narrow (1.0, 0.9;
    # among top-k's kept tokens with k = 3, 40 and 300); k past the finite tokens (60, the last row).
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (4.0, 0, 0.9, 0.0),
                                             (1.0, 0, 0.9, 0.0), (0.8, 40, 0.95, 0.05), (2.0, 0, 1.0, 0.1),
                                             (1.0, 3, 0.5, 0.0), (1.0, 300, 0.9, 0.0), (1.0, 60, 0.99, 0.0)]:
        logits = torch.randn(3001, generator=gen) * 4
        logits[::97] = -math.inf  # masked (a grammar, blocked ids)
        if top_k == 60:
            logits[50:] = -math.inf
        lower, upper, keep = reference_intervals(logits, temperature, top_k, top_p, min_p)
        kept = keep.nonzero().squeeze(1)
        wide = kept[(upper - lower)[kept] > 1e-5]
        wide = wide[torch.randperm(len(wide), generator=gen)[:300]]
        uniforms = torch.cat([(lower[wide] + upper[wide]) / 2, torch.tensor([0.0, 1 - 1e-12], dtype=torch.float64)])
        drawn = draw_with(build, logits.repeat(len(uniforms), 1), temperature, top_k, top_p, min_p, uniforms)
        params = (temperature, top_k, top_p, min_p)
        assert drawn[:-2].tolist() == wide.tolist(), params
        assert drawn[-2:].tolist() == [int(kept[0]), int(kept[-1])], params


@pytest.mark.parametrize("build", BUILDS)
def test_a_row_with_a_nan_or_no_finite_logit_gets_argmaxs_answer(build):
    logits = torch.randn(3, 700)
    logits[0, 600] = logits[0, 650] = math.nan
    logits[1] = -math.inf
    logits[2, 5] = math.nan
    assert draw_with(build, logits, 0.8, 10, 0.9, 0.0, torch.full((3,), 0.5, dtype=torch.float64)).tolist() == [600, 0, 5]


@pytest.mark.skipif(why_not_native() is not None, reason="no native kernels")
def test_the_native_draw_refuses_bad_input():
    ops = fused_ops()
    ones = torch.ones(2)
    u = torch.full((2,), 0.5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32 logits"):
        ops.sample_rows(torch.zeros(2, 5, dtype=torch.float64), ones, None, None, None, u)
    with pytest.raises(RuntimeError, match="uniforms must be a contiguous"):
        ops.sample_rows(torch.zeros(2, 5), ones, None, None, None, u.float())
    with pytest.raises(RuntimeError, match="top_k must be a contiguous"):
        ops.sample_rows(torch.zeros(2, 5), ones, torch.ones(3, dtype=torch.long), None, None, u)


@pytest.mark.parametrize("native", PATHS)
def test_top_k_off_spellings_and_oversized_k_leave_the_distribution_alone(native):
    logits = torch.zeros(1, 6).repeat(3000, 1)
    for k in (0, -1, 6, 100):
        assert set(sample(logits, [row(top_k=k)] * 3000, native=native).token_ids) == set(range(6)), k


# -- per-request seeds -----------------------------------------------------------------------------


def run_steps(batches, steps=6, vocab_size=500):
    """Step a few batches; each is a list of (name, params) rows. Rows with a seed keep a generator
    across steps, as the engine does. Logits depend only on the row's own history (so the seeded
    row sees the same logits in every batch). Returns every row's tokens by name."""
    sampler = Sampler(device=CPU, seed=123)
    history = {name: [] for batch in batches for name, _ in batch}
    generators = {name: make_generator(p.seed, CPU) for batch in batches for name, p in batch if p.seed is not None}
    for _ in range(steps):
        for batch in batches:
            logits = torch.stack(
                [torch.randn(vocab_size, generator=torch.Generator().manual_seed(len(history[name]))) for name, _ in batch]
            )
            rows = [SamplingRow(p, [1, 2, 3], history[name], generators.get(name)) for name, p in batch]
            for (name, _), token in zip(batch, sampler(logits, SamplingBatch.build(rows, CPU)).token_ids):
                history[name].append(token)
    return history


def test_a_seeded_row_samples_the_same_alone_and_in_any_batch():
    mine = SamplingParams(temperature=1.3, top_p=0.95, frequency_penalty=0.3, seed=42)
    others = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0, seed=5),
        SamplingParams(temperature=1.0, top_k=3, seed=9),
        SamplingParams(temperature=2.0, min_p=0.1, repetition_penalty=1.2, logprobs=2),
    ]
    alone = run_steps([[("me", mine)]])["me"]
    front = run_steps([[("me", mine), *((f"o{i}", p) for i, p in enumerate(others))]])["me"]
    back = run_steps([[*((f"o{i}", p) for i, p in enumerate(others[::-1])), ("me", mine)]])["me"]
    interleaved = run_steps([[("o0", others[0])], [("o2", others[2]), ("me", mine)]])["me"]
    assert alone == front == back == interleaved
    assert len(set(alone)) > 1, "the seeded row should actually be sampling"
    assert run_steps([[("me", SamplingParams(temperature=1.3, top_p=0.95, frequency_penalty=0.3, seed=43))]])["me"] != alone


def test_two_requests_with_the_same_seed_sample_alike():
    logits = randn(1, 1000).repeat(3, 1)
    rows = [row(seed=7, generator=make_generator(7, CPU)), row(), row(seed=7, generator=make_generator(7, CPU))]
    tokens = sample(logits, rows).token_ids
    assert tokens[0] == tokens[2]


def test_unseeded_rows_are_reproducible_from_the_sampler_seed():
    logits = randn(16, 1000)
    rows = [row()] * 16
    assert sample(logits, rows, seed=1).token_ids == sample(logits, rows, seed=1).token_ids
    assert sample(logits, rows, seed=1).token_ids != sample(logits, rows, seed=2).token_ids


# -- penalties -------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0]])
    out = sample(logits, [row(temperature=0, prompt=[0, 3], output=[1], repetition_penalty=2.0, logprobs=5)])
    expected = torch.tensor([1.0, -4.0, 1.0, 0.0, 3.0])  # 0 and 1 seen (prompt, output); 3 seen but zero
    assert torch.allclose(full_logprobs(out.logprobs[0], 5), torch.log_softmax(expected, dim=-1))


def test_repetition_penalty_matches_hf_over_prompt_and_output():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 20, generator=g) * 4
    seqs = [torch.randint(0, 20, (n,), generator=g).tolist() for n in (3, 7, 1, 12)]
    rows = [row(temperature=0, prompt=s[:2], output=s[2:], repetition_penalty=1.7, logprobs=20) for s in seqs]
    out = sample(logits, rows)
    for i, s in enumerate(seqs):
        hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([s]), logits[i : i + 1].clone())[0]
        assert torch.allclose(full_logprobs(out.logprobs[i], 20), torch.log_softmax(hf, dim=-1), atol=1e-6)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    r = row(temperature=0, prompt=[4, 4, 4], output=[2, 2, 3, 2], frequency_penalty=0.5, presence_penalty=1.0, logprobs=5)
    out = sample(logits, [r])
    expected = torch.tensor([0.0, 0.0, -(0.5 * 3 + 1.0), -(0.5 + 1.0), 0.0])
    assert torch.allclose(full_logprobs(out.logprobs[0], 5), torch.log_softmax(expected, dim=-1))


def test_negative_penalties_reward_repeats_and_penalties_touch_only_their_rows():
    logits = torch.zeros(2, 4)
    rows = [row(temperature=0, output=[3], presence_penalty=-2.0, logprobs=4), row(temperature=0, output=[3], logprobs=4)]
    out = sample(logits, rows)
    assert out.token_ids == [3, 0]
    assert torch.allclose(full_logprobs(out.logprobs[0], 4), torch.log_softmax(torch.tensor([0.0, 0, 0, 2]), dim=-1))
    assert torch.allclose(full_logprobs(out.logprobs[1], 4), torch.full((4,), math.log(0.25)))


def test_the_callers_logits_are_left_untouched():
    logits = randn(3, 50)
    before = logits.clone()
    sample(logits, [row(output=[1, 1], repetition_penalty=1.5, frequency_penalty=1, top_k=3, top_p=0.5, min_p=0.2)] * 3)
    assert torch.equal(logits, before)


# -- logprobs --------------------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_of_the_logits_whatever_the_temperature_and_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 2
    rows = [
        row(temperature=0, logprobs=3),
        row(temperature=0.5, top_k=4, logprobs=5),
        row(temperature=1.5, top_p=0.3, min_p=0.1, logprobs=0),
        row(),
        row(temperature=1.0, logprobs=20),
    ]
    out = sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[3] is None
    for i in (0, 1, 2, 4):
        lp = out.logprobs[i]
        n = rows[i].params.logprobs
        assert lp.logprob == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
        top = reference[i].topk(n) if n else None
        assert lp.top_ids == (top.indices.tolist() if n else [])
        assert lp.top_logprobs == pytest.approx(top.values.tolist() if n else [], abs=1e-6)


def test_logprobs_ask_for_more_than_the_vocabulary():
    out = sample(torch.tensor([[0.0, 1.0]]), [row(temperature=0, logprobs=20)])
    assert out.logprobs[0].top_ids == [1, 0]


def test_half_precision_logits_are_accepted():
    logits = randn(2, 100).to(torch.bfloat16)
    out = sample(logits, [row(temperature=0, logprobs=1)] * 2)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


# -- errors ----------------------------------------------------------------------------------------


def test_invalid_inputs_get_clear_errors():
    batch = SamplingBatch.build([row(), row()], CPU)
    sampler = Sampler(device=CPU, seed=0)
    with pytest.raises(ValueError, match=r"2-D \[num_rows, vocab_size\], got shape \(10,\)"):
        sampler(torch.zeros(10), batch)
    with pytest.raises(ValueError, match="logits have 3 rows but the SamplingBatch has 2"):
        sampler(torch.zeros(3, 10), batch)
    with pytest.raises(ValueError, match="empty vocabulary"):
        sampler(torch.zeros(2, 0), batch)
    with pytest.raises(ValueError, match="floating point, got torch.int64"):
        sampler(torch.zeros(2, 10, dtype=torch.long), batch)
    with pytest.raises(ValueError, match="at least one row"):
        SamplingBatch.build([], CPU)
    with pytest.raises(ValueError, match=r"row 1 has seed 5 but no generator: keep make_generator\(params.seed, device\)"):
        SamplingBatch.build([row(), row(seed=5)], CPU)
    with pytest.raises(ValueError, match="token id 10 is out of range for a vocabulary of 10"):
        sampler(torch.zeros(2, 10), SamplingBatch.build([row(), row(output=[10], presence_penalty=1)], CPU))
    with pytest.raises(ValueError, match="token id 12 is out of range"):
        sampler(torch.zeros(2, 10), SamplingBatch.build([row(prompt=[12], repetition_penalty=1.1), row()], CPU))


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    """Until min_tokens outputs exist, EOS and stop token ids cannot be sampled, however likely."""
    logits = torch.zeros(1, 8)
    logits[0, 3] = 50.0  # EOS
    logits[0, 5] = 40.0  # a stop token
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,))
    sampler = Sampler(device=CPU, seed=0)
    early = SamplingBatch.build([SamplingRow(params, [1], [7], eos_token_id=3)], CPU)
    assert sampler(logits, early).token_ids == [0]  # the best token that neither stops nor is blocked
    done = SamplingBatch.build([SamplingRow(params, [1], [7, 7], eos_token_id=3)], CPU)
    assert sampler(logits, done).token_ids == [3]
    ignoring = SamplingBatch.build([SamplingRow(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), [1], [],
                                                eos_token_id=3)], CPU)
    assert sampler(logits, ignoring).token_ids == [3]  # EOS is an ordinary token when ignored


# -- the move to the device -------------------------------------------------------------------------


def test_a_batch_for_another_device_is_built_on_the_host_and_moved_once(monkeypatch):
    """Off the CPU every tensor of the batch (penalties' included) goes to the device in one to_device
    call (pinned, non-blocking, int64 packed; metadata.to_device), not one blocking copy each. Here
    the move is a clone to a pretend device: the moved batch holds the host batch's values."""
    import blockserve.worker.sampling_batch as sampling_batch_module

    moves = []
    monkeypatch.setattr(sampling_batch_module, "to_device", lambda tree, device: moves.append(device) or
                        pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree))
    rows = [row(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, logprobs=2, logit_bias={3: 1.5}),
            row(prompt=[1, 2], output=[4], repetition_penalty=1.2, presence_penalty=0.5),
            row(temperature=0)]
    meta = torch.device("meta")
    moved, host = SamplingBatch.build(rows, meta), SamplingBatch.build(rows, CPU)
    assert moves == [meta] and moved.device == meta and host.device == CPU

    def leaves(batch):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "device"]
        return pytree.tree_leaves([dataclasses.astuple(v) if dataclasses.is_dataclass(v) else v for v in values])

    assert moved.penalties is not None and moved.logit_bias is not None and moved.top_k is not None
    assert len(leaves(moved)) == len(leaves(host))
    for a, b in zip(leaves(moved), leaves(host)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
