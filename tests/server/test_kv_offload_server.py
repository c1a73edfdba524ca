"""A `blockserve serve` with a disk tier, stopped and started again: the same long prompt then
reports cached tokens from the tier, with the same greedy answer; another salt gets none; /metrics
shows the tier."""

from __future__ import annotations

import re

import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow  # two servers on the bundled model

PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))


def complete(server: ServerProcess, salt: str | None = None) -> tuple[str, int]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restarted_server_answers_from_its_disk_tier(tmp_path):
    args = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--num-threads", "1",
            "--kv-offload-dir", str(tmp_path / "kv")]
    with ServerProcess(args) as server:
        text, cached = complete(server)
        assert cached == 0
    with ServerProcess(args) as server:
        again, cached = complete(server)
        assert again == text and cached > 300
        assert complete(server, salt="another tenant")[1] == 0
        status, metrics = server.request("GET", "/metrics")
        assert status == 200
        hits = re.search(r'blockserve_kv_tier_hits_total\{model_name="[^"]*",tier="disk"\} (\S+)', metrics)
        assert hits and float(hits.group(1)) == cached // 16
        assert re.search(r"blockserve_kv_tier_writes_dropped_bytes_total\{[^}]*\} 0", metrics)
        assert re.search(r"blockserve_kv_tier_queue_bytes\{[^}]*\} ", metrics)
        assert re.search(r"blockserve_kv_tier_write_failures_total\{[^}]*\} 0", metrics)
        tier_tokens = re.search(r"blockserve_prefix_cache_tier_hits_total\{[^}]*\} (\S+)", metrics)
        assert tier_tokens and float(tier_tokens.group(1)) == cached
