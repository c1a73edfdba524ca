"""The GPU check (blockserve/bench/gpu_check.py) in its CPU smoke mode (`--device cpu --smoke`): every
section runs and reports what it must, so the check that only a GPU machine runs in full cannot rot unseen; and its parity
and poison sections at their full grid, in float32 on the CPU. Never asserts on wall-clock figures,
only that they are there and positive."""

from __future__ import annotations

import importlib
import json
import time

import pytest
import torch

from blockserve.bench import gpu_check as gpu_check_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_gpu_check():
    """The check's module with its globals fresh (some tests set them)."""
    return importlib.reload(gpu_check_module)


def test_smoke_mode_runs_every_section(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()
    checks, build = [], gpu_check.LLM  # each engine's check_integrity
    monkeypatch.setattr(gpu_check, "LLM", lambda *args, **options: checks.append(options["check_integrity"])
                        or build(*args, **options))
    written = []
    report = gpu_check.run("cpu", smoke=True, budget_s=600, write=lambda r: written.append(json.dumps(r)))
    assert len(written) == 5 and "poison" in json.loads(written[0])  # after each section, and at the end
    assert report["ok"], gpu_check.summary(report)
    assert {"torch", "triton", "transformers", "python"} <= set(report["environment"])
    assert "regret" in report["parity_rule"]
    runs = report["parity"]["runs"]
    assert set(runs) == {"gemma3/exact/prefix-caching", "gemma3/exact/preemption"}
    assert runs["gemma3/exact/preemption"]["preemptions"] > 0
    assert len(runs["gemma3/exact/prefix-caching"]["passes"]) == 2  # the second pass is served from the cache
    poison = report["poison"]["backends"]
    assert poison["exact"]["zeroing_off_matches"] and not poison["whole_block"]["zeroing_off_matches"]
    assert all(b["derived_flags_match"] and b["preemptions"] > 0 for b in poison.values())
    kernels = report["attention"]["kernels"]
    assert set(kernels) == {"exact/2x40"} and kernels["exact/2x40"]["us"] > 0 and not report["attention"]["skipped"]
    throughput = report["throughput"]
    assert throughput["copy_bandwidth_gb_s"] > 0
    assert not throughput["errors"] and not throughput["skipped"]
    for row in throughput["batches"].values():
        assert row["transformers_tok_s"] > 0 and row["blockserve_exact_tok_s"] > 0 and row["hbm_bound_tok_s"] > 0
        # on the CPU nothing is waited for: the step is host work
        assert row["blockserve_exact_step_ms"] >= row["blockserve_exact_host_ms"] > 0
        assert row["blockserve_exact_device_wait_ms"] < 0.1 * row["blockserve_exact_step_ms"]
    # parity and poison engines check the KV books after every step; throughput's (the last) do not
    assert checks[0] is True and checks[-1] is False
    assert throughput["fastest"] == {b: "exact" for b in throughput["batches"]}
    text = gpu_check.summary(report)
    assert "OK" in text and "parity: 2/2 ok" in text and "poison: 2/2 ok" in text
    assert "fastest blockserve variant per batch: 1: exact, 4: exact" in text
    assert "attention decode layer (us, KV GB/s): exact/2x40 " in text


def test_the_attention_timings_run_every_backend(monkeypatch):
    """The attention section's layer timings (smoke shapes) through every GPU backend on the CPU: flex
    eager, triton interpreted; each gives a time, none an error; and flex's block mask build."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "backends", lambda device, smoke, names=None: list(gpu_check.GPU_BACKENDS))
    attention = gpu_check.attention_kernels("cpu", torch.float32, smoke=True, until=time.perf_counter() + 300)
    kernels, masks = attention["kernels"], attention["flex_masks"]
    assert set(kernels) == {f"{b}/2x40" for b in gpu_check.GPU_BACKENDS}
    assert all(r.get("us", 0) > 0 for r in kernels.values()), kernels
    assert set(masks) == {"2x40"} and masks["2x40"]["us"] > 0, masks  # flex's block mask over a full cache


def run_parity_grid(gpu_check, backends: tuple[str, ...]) -> None:
    """The parity section's family x scenario grid for `backends`, in float32 on the CPU: all pass."""
    gpu_check.GPU_BACKENDS = backends
    parity = gpu_check.parity("cpu", torch.float32, smoke=False, until=time.perf_counter() + 900)
    runs = parity["runs"]
    assert set(runs) == {f"{family}/{backend}/{scenario}" for family in gpu_check.FAMILIES
                         for backend in backends for scenario in gpu_check.SCENARIOS}
    assert parity["ok"] and not parity["skipped"], json.dumps({k: r for k, r in runs.items() if not r["ok"]})[:2000]
    assert all(r["preemptions"] > 0 for k, r in runs.items() if k.endswith("/preemption"))


@pytest.mark.slow
def test_parity_and_poison_run_their_full_grid_on_the_cpu():
    """Every family x scenario of the parity section for exact, and the poison section for exact and
    whole_block, as the GPU run has them, in float32: all pass, the hybrid models' preemption runs
    included (their small cache once left no room for the state slots the engine reserves, a failure
    only the full grid could show). Flex's and Triton's grids are the next tests'."""
    gpu_check = load_gpu_check()
    assert gpu_check.GPU_BACKENDS == ("exact", "flex", "triton")
    run_parity_grid(gpu_check, ("exact",))
    poison = gpu_check.poison("cpu", torch.float32, smoke=False, names=("exact", "whole_block"))
    assert poison["ok"], json.dumps(poison)[:2000]
    assert set(poison["backends"]) == {"exact", "whole_block"}


@pytest.mark.backend_full  # ~25 s: flex eager and Triton interpreted (their kernels' own C1 tests run by default)
def test_poison_runs_flex_and_triton_on_the_cpu():
    poison = load_gpu_check().poison("cpu", torch.float32, smoke=False, names=("flex", "triton"))
    assert poison["ok"], json.dumps(poison)[:2000]
    assert set(poison["backends"]) == {"flex", "triton"}


@pytest.mark.backend_full  # about a minute: flex runs eager on the CPU (its own parity: attention/test_flex_attention.py)
def test_flex_parity_grid_on_the_cpu():
    run_parity_grid(load_gpu_check(), ("flex",))


@pytest.mark.backend_full  # ~70 s: Triton's interpreter (its engines: tests/attention/test_triton_attention.py)
def test_triton_parity_grid_on_the_cpu():
    run_parity_grid(load_gpu_check(), ("triton",))


def test_the_gpu_runs_measure_flex_and_triton_with_and_without_cuda_graphs_and_async(monkeypatch):
    gpu_check = load_gpu_check()
    assert gpu_check.engine_variants("cuda", False, [1, 16]) == {
        "flex_cuda_graphs": {"attention_backend": "flex", "cuda_graph_sizes": (1, 16)},
        "flex_cuda_graphs_async": {"attention_backend": "flex", "cuda_graph_sizes": (1, 16), "async_scheduling": True},
        "triton_cuda_graphs": {"attention_backend": "triton", "cuda_graph_sizes": (1, 16)},
        "triton_cuda_graphs_async": {"attention_backend": "triton", "cuda_graph_sizes": (1, 16),
                                     "async_scheduling": True},
        "exact_eager": {"attention_backend": "exact", "enforce_eager": True},
        "flex_eager": {"attention_backend": "flex", "enforce_eager": True},
        "triton_eager": {"attention_backend": "triton", "enforce_eager": True}}
    assert gpu_check.engine_variants("cpu", True, [1, 4]) == {
        "exact": {"attention_backend": "exact", "enforce_eager": False}}
    assert gpu_check.backends("cpu", False) == ["exact", "flex", "triton"]  # the tests run Triton interpreted
    monkeypatch.setattr(gpu_check, "triton_interpreting", lambda: False)
    assert gpu_check.backends("cpu", False) == ["exact", "flex"]  # a CPU run without the interpreter
    assert gpu_check.backends("cuda", False) == ["exact", "flex", "triton"]


def test_the_bfloat16_rule_passes_a_correct_engine_and_fails_a_broken_one(tmp_path):
    """The GPU run's rule, in bfloat16 on the CPU: the engine's greedy tokens pass (their mean regret
    under the float32 model is within the margin of transformers' own bfloat16 tokens'), tokens from a
    broken path (here: each sequence's tokens shifted by one position) fail."""
    gpu_check = load_gpu_check()
    batch = gpu_check.prompts(8)
    reference = gpu_check.Reference.build("llama", tmp_path / "llama", "cpu", torch.bfloat16, batch, 10)
    with gpu_check.engine(str(tmp_path / "llama"), "cpu", torch.bfloat16, attention_backend="exact") as llm:
        got = gpu_check.greedy(llm, batch, 10)
    verdict = gpu_check.judge(got, reference)
    assert verdict["ok"] and verdict["mean_regret"] >= 0, verdict
    broken = gpu_check.judge([tokens[1:] + tokens[:1] for tokens in got], reference)
    assert not broken["ok"] and broken["mean_regret"] > 1, broken


@pytest.mark.slow
def test_isolated_parts_give_the_in_process_report():
    """CUDA's default: the throughput baseline and each backend's sections in processes of their own
    (a CUDA fault is sticky), merged into one report with the same sections as an in-process run."""
    gpu_check = load_gpu_check()
    report = gpu_check.run_isolated("cpu", smoke=True, budget_s=600)
    assert report["ok"], gpu_check.summary(report)
    assert {unit: u["rc"] for unit, u in report["units"].items()} == {"baseline": 0, "exact": 0, "whole_block": 0}
    assert set(report["poison"]["backends"]) == {"exact", "whole_block"}
    assert set(report["parity"]["runs"]) == {"gemma3/exact/prefix-caching", "gemma3/exact/preemption"}
    assert set(report["attention"]["kernels"]) == {"exact/2x40"}
    rows = report["throughput"]["batches"]
    assert set(rows) == {1, 4} and all(row["transformers_tok_s"] > 0 and row["blockserve_exact_tok_s"] > 0
                                       for row in rows.values())
    assert report["throughput"]["fastest"] == {1: "exact", 4: "exact"}
    assert "parts (exit code, seconds): baseline 0" in gpu_check.summary(report)


def test_the_parts_share_the_parity_references(tmp_path, monkeypatch):
    """transformers' reference outputs (and in bfloat16 its own regret) are computed by the first part
    that needs them and read back by the next, for the same weights, prompts and length only."""
    gpu_check = load_gpu_check()
    calls, reference_outputs = [], gpu_check.reference_outputs
    monkeypatch.setattr(gpu_check, "reference_outputs", lambda *args: calls.append(args) or reference_outputs(*args))
    batch = gpu_check.prompts(2)
    first = gpu_check.Reference.build("gemma3", tmp_path / "a", "cpu", torch.bfloat16, batch, 3, tmp_path)
    assert len(calls) == 2  # float32, then bfloat16 for its regret
    again = gpu_check.Reference.build("gemma3", tmp_path / "b", "cpu", torch.bfloat16, batch, 3, tmp_path)
    assert len(calls) == 2 and again.low_precision_regret == first.low_precision_regret is not None
    assert [(t, [lp.tolist() for lp in lps]) for t, lps in again.outputs] == \
        [(t, [lp.tolist() for lp in lps]) for t, lps in first.outputs]
    gpu_check.Reference.build("gemma3", tmp_path / "c", "cpu", torch.bfloat16, batch, 4, tmp_path)
    assert len(calls) == 4  # another length: computed anew


def test_a_part_that_dies_is_named_and_fails_the_check(tmp_path):
    """A part stopped at its deadline (as one hung by a fault would be) leaves its sections unfinished:
    they are named under failed_units with the exit and the log's tail, and the check fails."""
    gpu_check = load_gpu_check()
    outcome = gpu_check._part("cpu", True, ["--sections", "poison", "--backends", "exact", "--results",
                                            str(tmp_path / "exact"), "--in-process"], 0.2, tmp_path / "exact.log")
    assert outcome["rc"] == "timeout" and "log_tail" in outcome
    report = {"poison": {"backends": {}}}
    gpu_check.merge(report, {}, "exact", ["poison"], outcome)
    gpu_check._finish_merged(report, time.perf_counter())
    assert report["poison"]["failed_units"] == {"exact": outcome} and not report["ok"]
    gpu_check.merge(report, {"poison": {"skipped": "over the 5 s budget"}}, "flex", ["poison"], {"rc": 0})
    assert report["poison"]["skipped"] == ["flex (over the 5 s budget)"]  # not started for time: not a failure
    assert set(report["poison"]["failed_units"]) == {"exact"}


def test_the_goals_are_read_off_the_best_variant():
    gpu_check = load_gpu_check()
    rows = {1: {"blockserve_flex_cuda_graphs_vs_hbm_bound": 0.7, "blockserve_exact_eager_vs_hbm_bound": 0.9},
            16: {"blockserve_flex_cuda_graphs_vs_transformers": 4.0, "blockserve_triton_eager_vs_transformers": 2.0,
                 "blockserve_flex_cuda_graphs_vs_hbm_bound": 0.2},
            256: {"blockserve_triton_cuda_graphs_async_vs_hbm_bound": 0.3, "blockserve_flex_eager_vs_hbm_bound": 0.1,
                  "blockserve_triton_cuda_graphs_async_vs_transformers": 2.5}}
    goals = gpu_check.goals(rows)
    assert goals["largest_batch_vs_hbm_bound>=0.5"] == {"batch": 256, "value": 0.3, "variant": "triton_cuda_graphs_async",
                                                        "met": False}
    # batch 1 counts graphs only: exact eager's 0.9 is not a graph run
    assert goals["batch_1_graphs_vs_hbm_bound>=0.667"] == {"value": 0.7, "variant": "flex_cuda_graphs", "met": True}
    assert goals["vs_transformers>=3_at_every_batch>1"] == {"met": False, "lowest": 2.5}
    assert gpu_check.goals({}) == {"largest_batch_vs_hbm_bound>=0.5": None, "batch_1_graphs_vs_hbm_bound>=0.667": None,
                                   "vs_transformers>=3_at_every_batch>1": None}


def test_the_cli_runs_the_check():
    from blockserve.cli import build_parser

    args = build_parser().parse_args(["bench", "gpu-check", "--device", "cpu", "--smoke", "--sections", "poison"])
    assert args.func is gpu_check_module.command
    assert (args.device, args.smoke, args.sections) == ("cpu", True, ("poison",))
