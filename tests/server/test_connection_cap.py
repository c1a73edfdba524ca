"""--max-connections over real sockets: uvicorn, configured as `blockserve serve` configures it
(http/draining.py: uvicorn_config), in a thread of this process. Connections up to the cap are
served, idle ones included; past it a new connection's request gets 503 in OpenAI's shape with
Retry-After and the connection is closed; once a connection closes, a new one is served again."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

from blockserve.cli import build_parser, server_config
from blockserve.server.config import ServerConfig
from blockserve.server.http.draining import uvicorn_config
from tests.server_process import free_port


async def ok_app(scope, receive, send):
    """200 `{}` to every request (the cap is the protocol's, before any app runs)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


@contextlib.contextmanager
def serving(config: ServerConfig):
    import uvicorn

    server = uvicorn.Server(uvicorn_config(ok_app, config))
    thread = threading.Thread(target=server.run, name="connection-cap-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(30)


def get(connection: http.client.HTTPConnection) -> tuple[int, dict, dict]:
    connection.request("GET", "/health")
    response = connection.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def test_past_the_cap_a_new_connection_gets_a_503_in_openais_shape_and_is_closed():
    config = ServerConfig(host="127.0.0.1", port=free_port(), max_connections=2, header_timeout=10)
    with serving(config):
        held = [http.client.HTTPConnection("127.0.0.1", config.port, timeout=10) for _ in range(2)]
        for connection in held:  # served, then kept open (idle, kept alive): each still counts
            assert get(connection)[0] == 200
        over = socket.create_connection(("127.0.0.1", config.port), timeout=10)
        over.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while chunk := over.recv(65536):  # the server closes it after the answer
            raw += chunk
        over.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        assert lines[0].startswith("HTTP/1.1 503"), raw
        assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
        assert headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        assert "2" in error["message"] and "--max-connections" in error["message"]
        assert get(held[0])[0] == 200  # the connections within the cap are untouched

        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the close a moment later; then a new connection is served
            fresh = http.client.HTTPConnection("127.0.0.1", config.port, timeout=10)
            status = get(fresh)[0]
            fresh.close()
            if status == 200:
                break
            assert time.monotonic() < deadline, "the freed connection was never given back"
            time.sleep(0.05)
        for connection in held:
            connection.close()


def test_the_cap_is_a_serve_flag():
    assert server_config(build_parser().parse_args(["serve", "--max-connections", "7"])).max_connections == 7
    assert ServerConfig().max_connections == 1000
