"""The data-parallel front end in process, over two stand-in replicas: one whose process lives but
refuses connections, one a plain HTTP server. A request the first refuses goes to the second (it
never reached the first, so nothing is lost); the first leaves the rotation and /metrics says so;
nothing stays in flight; a body reaches the replica as the client sent it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families

from blockserve.data_parallel.replicas import LOOPBACK, ReplicaProcess, free_port
from blockserve.data_parallel.router import Replicas, create_router_app
from blockserve.data_parallel.routing import DataParallelConfig
from blockserve.engine.config import EngineConfig
from blockserve.server.config import ServerConfig
from tests.server.asgi import asgi_request

CHAT = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True}
METRICS = "# HELP blockserve_generation_tokens_total Tokens generated.\n" \
          "# TYPE blockserve_generation_tokens_total counter\nblockserve_generation_tokens_total 7.0\n"


class _Replica(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._answer(json.dumps({"served": self.path, "body": body}).encode(), "application/json")

    def do_GET(self):
        self._answer(METRICS.encode(), "text/plain; version=0.0.4")

    def _answer(self, payload: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def test_a_refused_connection_takes_the_replica_out_and_the_request_to_the_next():
    server = ThreadingHTTPServer((LOOPBACK, 0), _Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alive = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]  # processes that live: only the port refuses
    processes = [ReplicaProcess(0, free_port(), alive[0]), ReplicaProcess(1, server.server_address[1], alive[1])]
    try:
        async def run():
            replicas = Replicas(processes, DataParallelConfig())
            app = create_router_app(replicas, EngineConfig(model=None), ServerConfig(), tokenizer=None)
            try:
                status, _, body = await asgi_request(app, "POST", "/v1/completions", {"prompt": [1, 2, 3]})
                _, _, chat = await asgi_request(app, "POST", "/v1/chat/completions", CHAT)
                _, _, metrics = await asgi_request(app, "GET", "/metrics")
                return replicas, status, json.loads(body), json.loads(chat), metrics.decode()
            finally:
                await replicas.client.aclose()

        replicas, status, body, chat, metrics = asyncio.run(run())
    finally:
        server.shutdown()
        for process in alive:
            process.kill()
            process.wait()
    assert status == 200 and body == {"served": "/v1/completions", "body": {"prompt": [1, 2, 3]}}  # replica 1
    assert chat == {"served": "/v1/chat/completions", "body": CHAT}  # chat_template_kwargs reach the replica
    assert [load.alive for load in replicas.loads] == [False, True]
    assert [load.in_flight for load in replicas.loads] == [0, 0]
    assert replicas.routed["no_match"] == 3  # the pick that was refused, then the one that served, then the chat
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert samples[("blockserve_router_replica_up", (("replica", "0"),))] == 0
    assert samples[("blockserve_generation_tokens_total", (("replica", "1"),))] == 7
    assert samples[("blockserve_generation_tokens_total", (("replica", "total"),))] == 7
