"""`blockserve bench throughput | latency | serve` on a tiny random Llama, through the CLI.

Only shapes and counts are checked (and that rates and latencies are positive): never wall-clock values.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from blockserve.bench.common import percentile, summarize
from blockserve.cli import main
from tests.benchmark.conftest import VOCAB
from tests.server_process import ServerProcess

THREAD_KEYS = {"torch_num_threads", "torch_num_interop_threads", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
               "GOMP_SPINCOUNT"}


def bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["-q", "bench", *argv, "--no-progress", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert THREAD_KEYS <= set(result["thread_settings"])
    assert result["thread_settings"]["torch_num_threads"] == torch.get_num_threads()
    assert THREAD_KEYS <= set(result["environment"])
    return result


def check_summary(s: dict, count: int | None = None) -> None:
    if count is not None:
        assert s["count"] == count
    assert s["count"] > 0
    assert 0 < s["min"] <= s["median"] <= s["p90"] <= s["p99"] <= s["max"]
    assert s["min"] - 1e-9 <= s["mean"] <= s["max"] + 1e-9  # a mean of equal values may round by an ulp


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))
    assert summarize([])["count"] == 0 and summarize([])["median"] is None
    assert summarize([0.001, 0.003], 1e3)["median"] == pytest.approx(2.0)


@pytest.mark.parametrize("workload", ["random", "chat"])
def test_throughput(tiny_model, tmp_path, workload):
    extra = ["--random-input-len", "12", "--num-prompts", "5"] if workload == "random" else ["--num-prompts", "4"]
    r = bench(tmp_path, "throughput", "--model", tiny_model, "--max-tokens", "6", "--rounds", "2", "--no-roofline",
              *extra)
    n = 5 if workload == "random" else 4
    assert r["benchmark"] == "throughput"
    assert r["num_requests"] == r["workload"]["num_prompts"] == n
    assert r["generated_tokens"] == r["expected_generated_tokens"] == n * 6
    if workload == "random":
        assert r["prompt_tokens"] == 5 * 12
    else:
        assert r["workload"]["kind"] == "the fixed chat workload"
        assert r["workload"]["prompt_len_min"] < r["workload"]["prompt_len_max"]  # spread over the lengths
    assert len(r["rounds"]) == 2
    for rnd in r["rounds"]:
        assert rnd["generated_tokens"] == n * 6 and rnd["requests"] == n
        assert rnd["preemptions"] == 0 and rnd["steps"] >= 6
        assert abs(sum(rnd["phase_share"].values()) - 1) < 1e-6
    for key in ("generated_tokens_per_s", "total_tokens_per_s", "requests_per_s", "seconds"):
        assert r[key] > 0
    assert r["total_tokens_per_s"] > r["generated_tokens_per_s"]
    assert r["roofline"] is None and r["engine"]["model"] == tiny_model


def test_latency(tiny_model, tmp_path):
    iters, new = 2, 5
    r = bench(tmp_path, "latency", "--model", tiny_model, "--random-input-len", "10", "--max-tokens", str(new),
              "--batch-sizes", "1", "3", "--num-iters", str(iters), "--num-warmup-iters", "1", "--no-roofline")
    assert r["benchmark"] == "latency"
    assert [s["batch_size"] for s in r["batch_sizes"]] == [1, 3]
    for s in r["batch_sizes"]:
        b = s["batch_size"]
        assert s["iterations"] == iters and s["generated_tokens_per_iteration"] == b * new
        check_summary(s["ttft_ms"], b * iters)
        check_summary(s["e2e_ms"], b * iters)
        check_summary(s["tpot_ms"], b * iters)
        check_summary(s["itl_ms"], b * iters * (new - 1))  # one token per request per step
        assert s["e2e_ms"]["min"] > s["ttft_ms"]["min"]
        assert s["generated_tokens_per_s"] > 0 and all(t > 0 for t in s["iteration_seconds"])


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(["--model", tiny_model, "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                        "--num-threads", "1"]) as proc:
        yield proc


def check_load(load: dict, requests: int, new: int) -> None:
    assert load["completed"] == requests and load["failed"] == 0 and load["errors"] == []
    assert load["completion_tokens"] == requests * new
    assert load["completion_tokens_per_request"] == [new] * requests
    assert load["prompt_tokens"] > 0
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert load[key] > 0
    check_summary(load["ttft_ms"], requests)
    check_summary(load["e2e_ms"], requests)
    check_summary(load["tpot_ms"], requests)
    # gaps between content chunks: a server that falls behind sends several tokens in one chunk
    assert load["itl_ms"]["count"] <= requests * (new - 1)
    if load["itl_ms"]["count"]:
        check_summary(load["itl_ms"])


def test_serve_fixed_concurrency_chat(server, tmp_path):
    r = bench(tmp_path, "serve", "--base-url", server.base_url, "--num-prompts", "4", "--max-concurrency", "2",
              "--max-tokens", "6")
    assert r["benchmark"] == "serve" and r["endpoint"] == "chat" and r["model"] == server_model(server)
    (load,) = r["loads"]
    assert load["max_concurrency"] == 2 and load["request_rate"] == "inf"
    assert 1 <= load["peak_in_flight"] <= 2
    check_load(load, 4, 6)


def test_serve_request_rates_and_plot(server, tmp_path):
    png = tmp_path / "load.png"
    r = bench(tmp_path, "serve", "--base-url", server.base_url, "--random-input-len", "8", "--random-vocab-size",
              str(VOCAB), "--num-prompts", "3", "--max-tokens", "4", "--request-rate", "50", "inf", "--plot", str(png))
    assert r["endpoint"] == "completions"
    assert [load["request_rate"] for load in r["loads"]] == [50.0, "inf"]
    for load in r["loads"]:
        check_load(load, 3, 4)
        assert load["prompt_tokens"] == 3 * 8
    assert png.read_bytes().startswith(b"\x89PNG")


def server_model(server) -> str:
    status, body = server.request("GET", "/v1/models")
    assert status == 200
    return body["data"][0]["id"]


def test_the_chat_workload_has_64_conversations():
    from blockserve.bench import workloads

    assert len(workloads.CONVERSATIONS) == 64


def test_roofline_flops_of_the_tiny_model(tiny_model):
    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.bench.roofline import ModelShape, workload_flops
    from blockserve.models.loader import load_model

    loaded = load_model(tiny_model, BACKENDS["exact"])
    shape = ModelShape.of(loaded.model, loaded.hf_config)
    assert shape.layers == 2 and shape.hidden == 64 and shape.lm_head_params == VOCAB * 64
    flops = workload_flops(shape, [10, 20], 4)
    assert flops["generated_tokens"] == 8 and flops["computed_positions"] == (10 + 3) + (20 + 3)
    assert flops["total"] == pytest.approx(flops["linear"] + flops["lm_head"] + flops["attention"])
    # Prompt tokens served from the prefix cache are work not done: not counted.
    cached = workload_flops(shape, [10, 20], 4, cached_prompt_tokens=[0, 8])
    assert cached["computed_positions"] == flops["computed_positions"] - 8
    assert cached["linear"] == pytest.approx(flops["linear"] * (36 - 8) / 36)
    assert cached["attention"] == pytest.approx(shape.attention_flops(13 * 14 // 2 + 23 * 24 // 2 - 8 * 9 // 2))
