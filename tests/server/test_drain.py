"""SIGTERM drains the real `blockserve serve`: new requests and /health get 503 while in-flight
streams go on; a stream that ends within --shutdown-timeout completes, one that outlasts it gets an
error event (then [DONE]); the process exits 0 with the engine stopped."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a `blockserve serve` process

SHUTDOWN_TIMEOUT_S = 8
CLI_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--num-threads", "1",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


class Stream(threading.Thread):
    """A streamed completion read line by line; `started` is set at its first event."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.started = threading.Event()
        self.events: list[dict | str] = []

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"prompt": "Count to a thousand:", "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                self.events.append(data if data == "[DONE]" else json.loads(data))
                self.started.set()
        conn.close()


def test_sigterm_drains_in_flight_streams_refuses_new_requests_and_exits_0():
    with ServerProcess(CLI_ARGS) as server:
        short, long = Stream(server.port, max_tokens=40), Stream(server.port, max_tokens=2000)
        for stream in (short, long):
            stream.start()
        assert short.started.wait(60) and long.started.wait(60)
        assert short.is_alive()  # both are in flight when the signal comes
        server.process.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 10
        while (health := server.request("GET", "/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = health
        assert status == 503 and body["error"]["code"] == "server_draining", health
        assert "shutting down" in body["error"]["message"]

        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 1}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        refused = json.loads(response.read())
        conn.close()
        assert response.status == 503 and response.getheader("Retry-After") == "1", refused
        assert refused["error"]["code"] == "server_draining", refused
        status, text = server.request("GET", "/metrics")  # still answered while draining
        assert status == 200 and 'reason="draining"} 1.0' in text, text

        short.join(60)
        assert not short.is_alive() and short.events[-1] == "[DONE]"
        assert short.events[-2]["choices"][0]["finish_reason"] == "length"  # it completed during the drain

        long.join(SHUTDOWN_TIMEOUT_S + 30)
        assert not long.is_alive() and long.events[-1] == "[DONE]"
        error = long.events[-2]["error"]  # it outlasted the timeout: aborted, with an error event
        assert error["code"] == "shutdown_timeout" and "--shutdown-timeout" in error["message"], error
        assert len([e for e in long.events if "choices" in e]) < 2000

        assert server.process.wait(timeout=30) == 0, server.log()
        log = server.log()
        assert "draining" in log and "aborting 1 request(s)" in log and "engine stopped" in log, log
