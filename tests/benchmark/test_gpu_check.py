"""benchmarks/gpu_check.py's CPU smoke mode (`--device cpu --smoke`): every section runs and reports
what it must, so the script that only a GPU machine runs in full cannot rot unseen. Never asserts
on wall-clock figures, only that they are there and positive."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_mode_runs_every_section(tmp_path):
    gpu_check = load_gpu_check()
    written = []
    report = gpu_check.run("cpu", smoke=True, budget_s=600, write=lambda r: written.append(json.dumps(r)))
    assert len(written) == 4 and "poison" in json.loads(written[0])  # after each section, and at the end
    assert report["ok"], gpu_check.summary(report)
    assert {"torch", "triton", "transformers", "python"} <= set(report["environment"])
    assert "top 5" in report["near_tie_rule"]
    runs = report["parity"]["runs"]
    assert set(runs) == {"gemma3/exact/prefix-caching", "gemma3/exact/preemption"}
    assert runs["gemma3/exact/preemption"]["preemptions"] > 0
    assert len(runs["gemma3/exact/prefix-caching"]["passes"]) == 2  # the second pass is served from the cache
    poison = report["poison"]["backends"]
    assert poison["exact"]["zeroing_off_matches"] and not poison["whole_block"]["zeroing_off_matches"]
    assert all(b["derived_flags_match"] and b["preemptions"] > 0 for b in poison.values())
    throughput = report["throughput"]
    assert throughput["copy_bandwidth_gb_s"] > 0
    assert not throughput["errors"] and not throughput["skipped"]
    for row in throughput["batches"].values():
        assert row["transformers_tok_s"] > 0 and row["blockserve_exact_tok_s"] > 0 and row["hbm_bound_tok_s"] > 0
    text = gpu_check.summary(report)
    assert "OK" in text and "parity: 2/2 ok" in text and "poison: 2/2 ok" in text
