"""`blockserve serve --data-parallel-size 2` as a real process: prefix-affinity routing lands
repeated prefixes on the replica that cached them (more prefix-cache hits than round robin);
/metrics parses, per replica and in total; a client that leaves (streaming or not) has its
request aborted on its replica, the others unaffected; a replica that dies leaves the other
serving while its in-flight request gets 503 (its counters kept in the totals); replicas are
sent SIGTERM (so they drain and exit) when their front end is killed without a drain."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig

from blockserve.data_parallel.routing import DataParallelConfig, PrefixIndex, ReplicaLoad, RoutingPolicy, prefix_hashes
from blockserve.models.random_checkpoint import save_random_model
from tests.server_process import ServerProcess

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
BLOCK = 4
ENGINE_ARGS = ["--max-model-len", "4096", "--block-size", str(BLOCK), "--num-threads", "1",
               "--kv-cache-memory", "8MiB"]
TENANTS = 3  # odd, so round robin sends each tenant's requests to both replicas in turn
ROUNDS = 4
PREFIX_TOKENS = 8 * BLOCK


def workload() -> list[dict]:
    """Each tenant (its own salt) repeats its shared prefix with a fresh suffix, tenants interleaved."""
    requests = []
    for round_ in range(ROUNDS):
        for tenant in range(TENANTS):
            prefix = [(97 * tenant + 5 * j + 1) % 512 for j in range(PREFIX_TOKENS)]
            suffix = [(31 * round_ + 7 * tenant + j + 300) % 512 for j in range(3)]
            requests.append({"prompt": prefix + suffix, "max_tokens": 2, "temperature": 0,
                             "cache_salt": f"tenant-{tenant}"})
    return requests


def prefix_hits(server) -> int:
    """Both replicas' prefix-cache hits, labelled, beside their total. A replica whose scrape failed
    (the front end logs why) has no samples until one succeeds: up to 3 scrapes, a second apart."""
    for _ in range(3):
        hits = {s.labels["replica"]: s.value for s in scrape(server) if s.name == "blockserve_prefix_cache_hits_total"}
        if hits.keys() == {"0", "1", "total"}:
            return int(hits["0"] + hits["1"])
        time.sleep(1)
    raise AssertionError(f"replicas scraped: {sorted(hits)}; the front end's log ends:\n{server.log()[-4000:]}")


def run_workload(server) -> int:
    for body in workload():
        status, answer = server.request("POST", "/v1/completions", body)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 2
    return prefix_hits(server)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-dp")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


def serve_args(model_dir: str, routing: str) -> list[str]:
    return ["--model", model_dir, "--data-parallel-size", "2", "--dp-routing", routing, *ENGINE_ARGS]


@pytest.fixture(scope="module")
def round_robin_run(model_dir) -> dict:
    """The workload's prefix hits under round robin; then the front end is SIGKILLed (no drain, no
    stopping of its replicas): how many replicas began a drain of their own within 30 s (their log
    lines, in the front end's log); every replica is killed after."""
    with ServerProcess(serve_args(model_dir, "round_robin")) as server:
        hits = run_workload(server)
        pids = [r["pid"] for r in server.request("GET", "/health")[1]["replicas"]]
        drains_before = server.log().count("SIGTERM: draining")
        server.process.kill()
        server.process.wait()
        deadline = time.monotonic() + 30
        while server.log().count("SIGTERM: draining") - drains_before < len(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        drains = server.log().count("SIGTERM: draining") - drains_before
    for pid in pids:  # their drain and exit are the single server's (test_drain.py): not waited for here
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    return {"hits": hits, "replicas": len(pids), "drains": drains}


@pytest.fixture(scope="module")
def affinity_server(model_dir):
    with ServerProcess(serve_args(model_dir, "affinity")) as server:
        pids = [r["pid"] for r in server.request("GET", "/health")[1]["replicas"]]
        yield server
        assert server.process.poll() is None  # still up after every test: stopped (SIGTERM) below
    assert server.process.returncode == 0  # a drain, not a kill
    assert not any(running(pid) for pid in pids)  # SIGTERM drained the replicas too


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie awaiting its reaper)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow  # two `blockserve serve --data-parallel-size 2` processes
def test_affinity_routing_gets_more_prefix_hits_than_round_robin(affinity_server, round_robin_run, model_dir):
    hits, round_robin_hits = run_workload(affinity_server), round_robin_run["hits"]
    # Affinity: each tenant misses once, then hits its prefix on every later request. Round robin:
    # each tenant misses once on each replica.
    assert hits == TENANTS * (ROUNDS - 1) * PREFIX_TOKENS
    assert round_robin_hits == TENANTS * (ROUNDS - 2) * PREFIX_TOKENS
    samples = scrape(affinity_server)
    assert total(samples, "blockserve_prefix_cache_hits_total", replica="total") == hits
    assert total(samples, "blockserve_prefix_cache_queries_total", replica="total") == sum(
        total(samples, "blockserve_prefix_cache_queries_total", replica=r) for r in ("0", "1")) > hits
    requests = TENANTS * ROUNDS
    assert total(samples, "blockserve_e2e_request_latency_seconds_count", replica="total") == requests
    assert total(samples, "blockserve_e2e_request_latency_seconds_bucket", replica="total", le="+Inf") == requests
    status, text = affinity_server.request("GET", "/metrics")
    assert f'blockserve_router_requests_total{{reason="affinity"}} {TENANTS * (ROUNDS - 1)}' in text
    assert f'blockserve_router_requests_total{{reason="no_match"}} {TENANTS}' in text
    status, health = affinity_server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and all(r["alive"] for r in health["replicas"])
    status, models = affinity_server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == model_dir


@pytest.mark.slow  # a `blockserve serve --data-parallel-size 2` process
def test_replicas_drain_when_their_front_end_is_killed(round_robin_run):
    assert round_robin_run["drains"] == round_robin_run["replicas"] == 2  # the parent-death signal (SIGTERM)


@pytest.mark.slow  # a `blockserve serve --data-parallel-size 2` process
def test_streams_pass_through(affinity_server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", affinity_server.port, timeout=60)
    conn.request("POST", "/v1/completions", body='{"prompt": [1, 2, 3], "max_tokens": 3, "stream": true}',
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [line for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def scrape(server) -> list:
    """The front end's /metrics, parsed (so valid exposition text): its samples."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def in_flight_replica(server) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = next((r for r in server.request("GET", "/health")[1]["replicas"] if r["in_flight"]), None)
        if busy is not None:
            return busy
    raise AssertionError("the request never showed up in flight")


@pytest.mark.slow  # a `blockserve serve --data-parallel-size 2` process
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_has_its_request_aborted_on_the_replica(affinity_server, stream):
    before = scrape(affinity_server)
    # Long enough (seconds on this tiny model) that it cannot finish before the client leaves.
    body = json.dumps({"prompt": [9, 8, 7], "max_tokens": 4000, "ignore_eos": True, "temperature": 1.0,
                       "stream": stream}).encode()
    client = socket.create_connection(("127.0.0.1", affinity_server.port), timeout=60)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if stream:  # its headers: the front end relays the replica's stream
        received = b""
        while b"\r\n\r\n" not in received:
            received += client.recv(65536)
        assert received.startswith(b"HTTP/1.1 200") and b"text/event-stream" in received
    busy = in_flight_replica(affinity_server)
    replica = str(busy["replica"])
    deadline = time.monotonic() + 30
    while not total(scrape(affinity_server), "blockserve_num_requests_running", replica=replica):
        assert time.monotonic() < deadline, "the replica never started the request"
    status, other = affinity_server.request("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 200 and other["usage"]["completion_tokens"] == 4  # the others are served meanwhile
    client.close()  # the client leaves, unanswered

    def finished(samples, reason: str, on: str = "total") -> float:
        return total(samples, "blockserve_request_finished_total", replica=on, finished_reason=reason)

    deadline = time.monotonic() + 30
    while finished(after := scrape(affinity_server), "abort", replica) == finished(before, "abort", replica):
        assert time.monotonic() < deadline, "the replica never aborted the request"
    # The abort is counted as it happens; the gauges follow when the engine thread next publishes
    # its scheduler stats (the same loop iteration), so a scrape in between may still see it running.
    while total(after, "blockserve_num_requests_running", replica="total"):
        assert time.monotonic() < deadline, "the aborted request stayed in the running batch"
        after = scrape(affinity_server)
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert finished(after, "length") == finished(before, "length") + 1  # the other one only
    assert total(after, "blockserve_num_requests_running", replica="total") == 0
    assert total(after, "blockserve_kv_cache_usage_ratio", replica="total") == 0  # its blocks freed
    assert total(after, "blockserve_router_in_flight") == 0


@pytest.mark.slow  # a `blockserve serve --data-parallel-size 2` process
def test_a_dead_replica_leaves_rotation_and_its_in_flight_request_gets_503(affinity_server):
    result = {}

    def long_request():
        result["answer"] = affinity_server.request("POST", "/v1/completions", {
            "prompt": [5, 6, 7], "max_tokens": 2000, "n": 4, "ignore_eos": True, "temperature": 1.0})

    thread = threading.Thread(target=long_request)
    thread.start()
    busy = in_flight_replica(affinity_server)
    hits_before = total(scrape(affinity_server), "blockserve_prefix_cache_hits_total", replica=str(busy["replica"]))
    os.kill(busy["pid"], signal.SIGKILL)
    thread.join(timeout=60)
    status, error = result["answer"]
    assert status == 503, error
    assert error["error"]["code"] == "replica_unavailable" and error["error"]["type"] == "server_error"

    deadline = time.monotonic() + 10  # its exit is seen at once or by the front end's watcher (every 0.5 s)
    while (health := affinity_server.request("GET", "/health"))[1]["status"] != "degraded":
        assert time.monotonic() < deadline, health
    status, health = health
    assert status == 200
    assert [r["alive"] for r in health["replicas"]] == [r["replica"] != busy["replica"] for r in health["replicas"]]
    for body in workload()[:4]:  # the survivor takes every request, prefixes included
        status, answer = affinity_server.request("POST", "/v1/completions", body)
        assert status == 200, answer
    samples = scrape(affinity_server)
    dead = str(busy["replica"])
    assert total(samples, "blockserve_router_replica_up", replica=dead) == 0
    assert total(samples, "blockserve_router_replica_scraped", replica=dead) == 0
    assert total(samples, "blockserve_router_in_flight") == 0
    # what it served stays in its samples and the totals (they never go backwards); it runs nothing now
    assert total(samples, "blockserve_prefix_cache_hits_total", replica=dead) == hits_before
    alive = str(1 - busy["replica"])
    assert total(samples, "blockserve_prefix_cache_hits_total", replica="total") == hits_before + total(
        samples, "blockserve_prefix_cache_hits_total", replica=alive)
    assert not [s for s in samples if s.name == "blockserve_num_requests_running" and s.labels["replica"] == dead]


# -- the policy on its own ------------------------------------------------------------------------


def policy(**options) -> tuple[RoutingPolicy, list[ReplicaLoad]]:
    loads = [ReplicaLoad(i, PrefixIndex(64)) for i in range(2)]
    return RoutingPolicy(loads, DataParallelConfig(**options)), loads


def test_load_imbalance_overrides_affinity():
    routing, loads = policy(dp_load_imbalance=2)
    hashes = prefix_hashes(list(range(16)), BLOCK, None)
    first, reason = routing.choose(hashes)
    assert reason == "no_match"
    for _ in range(2):  # the holder gets up to 2 more in flight than the idle one
        assert routing.choose(hashes) == (first, "affinity")
    other, reason = routing.choose(hashes)
    assert other is not first and reason == "load"
    assert first.in_flight == 3 and other.in_flight == 1


def test_salts_keep_tenants_apart_and_the_index_is_bounded():
    routing, loads = policy()
    tokens = list(range(16))
    a, _ = routing.choose(prefix_hashes(tokens, BLOCK, "tenant-a"))
    assert loads[a.index].prefixes.matched_blocks(prefix_hashes(tokens, BLOCK, "tenant-b")) == 0
    assert loads[a.index].prefixes.matched_blocks(prefix_hashes(tokens, BLOCK, "tenant-a")) == 4
    index = PrefixIndex(3)
    hashes = prefix_hashes(tokens, BLOCK, None)
    index.add(hashes)
    assert len(index) == 3 and index.matched_blocks(hashes) == 0  # the oldest (first) block was dropped


def test_replicas_get_the_front_ends_flags_back():
    from blockserve.cli import build_parser, server_config
    from blockserve.config_args import config_from_namespace
    from blockserve.data_parallel.replicas import config_flags
    from blockserve.engine.config import EngineConfig

    argv = ["serve", "--data-parallel-size", "2", "--max-model-len", "512", "--block-size", "4", "--no-prefix-caching",
            "--kv-cache-memory", "8MiB", "--request-timeout", "12.5", "--served-model-name", "m", "--api-key", "k",
            "--json-max-integer-digits", "8"]
    args = build_parser().parse_args(argv)
    engine, server = config_from_namespace(EngineConfig, args), server_config(args)
    again = build_parser().parse_args(["serve", *config_flags(server), *config_flags(engine)])
    assert config_from_namespace(EngineConfig, again) == engine and server_config(again) == server
    assert engine.json_max_integer_digits == 8


def test_each_replica_gets_a_gpu_of_its_own():
    """On CUDA, replica i sees only the i-th visible GPU (as its cuda:0); on the CPU nothing changes;
    fewer GPUs than replicas, or one GPU named for all, is refused before anything starts."""
    from blockserve.data_parallel.replicas import replica_environments as envs
    from blockserve.engine.config import EngineConfig

    auto, cuda, cpu = EngineConfig(), EngineConfig(device="cuda"), EngineConfig(device="cpu")
    assert envs(auto, 2, {}, cuda_devices=0) == [{}, {}]  # auto without CUDA: the CPU
    assert envs(cpu, 2, {}, cuda_devices=4) == [{}, {}]
    assert envs(auto, 2, {}, cuda_devices=4) == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    chosen = {"CUDA_VISIBLE_DEVICES": "3, GPU-5f0e"}  # indices or UUIDs, as the front end was given them
    assert envs(cuda, 2, chosen, cuda_devices=2) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "GPU-5f0e"}]
    with pytest.raises(ValueError, match=r"needs a GPU per replica, but 2 are visible \(CUDA_VISIBLE_DEVICES=3, GPU"):
        envs(auto, 3, chosen, cuda_devices=2)
    with pytest.raises(ValueError, match="--device cuda:1 .one GPU for all. cannot be honoured"):
        envs(EngineConfig(device="cuda:1"), 2, {}, cuda_devices=2)
    with pytest.raises(ValueError, match="CUDA is not available"):
        envs(cuda, 2, {}, cuda_devices=0)


def test_chat_prompts_are_hashed_as_the_replica_renders_them():
    """The front end routes a chat by the tokens its replica will cache: the template rendered with
    the request's chat_template_kwargs and add_generation_prompt (both passed on to the replica in
    the body); reserved variables are the replica's 400 to give, so the chat is routed by load."""
    import copy

    from blockserve.data_parallel.router import prompt_token_ids
    from blockserve.engine.tokenizer import load_tokenizer

    tokenizer = copy.copy(load_tokenizer())
    tokenizer.chat_template = ("{% if formal %}Dear reader: {% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %} Answer:{% endif %}")
    messages = [{"role": "user", "content": "hello there"}]

    def ids(**fields) -> list[int] | None:
        return prompt_token_ids(tokenizer, "/v1/chat/completions", {"messages": messages, **fields})

    def encoded(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert ids() == encoded("hello there Answer:")
    assert ids(chat_template_kwargs={"formal": True}) == encoded("Dear reader: hello there Answer:")
    assert ids(chat_template_kwargs={"formal": True}, add_generation_prompt=False) == encoded("Dear reader: hello there")
    assert ids(chat_template_kwargs={"tokenize": False}) is None
    assert ids(chat_template_kwargs=["formal"]) is None
