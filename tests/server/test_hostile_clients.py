"""What the schema cannot express, sent over raw loopback sockets to a real `blockserve serve`
with the bundled model: garbage bytes, truncated JSON, bodies past --max-request-body-bytes
(declared, and chunked without a length), bytes that are not HTTP, a header past uvicorn's
bound, and slow-loris clients (headers a byte at a time, a body that never completes), bounded
in count and time, and cut off at --header-timeout / --body-timeout. Each gets a clear answer
(OpenAI's error shape wherever the request reached the app) or a closed connection, never a hang
or a crash; correct requests are served the whole time, and afterwards the server holds no KV
block."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a `blockserve serve` process

BODY_LIMIT = 65536
DEADLINE = 2.0  # the test server's --header-timeout and --body-timeout
CLI_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
            "--max-request-body-bytes", str(BODY_LIMIT), "--header-timeout", str(DEADLINE),
            "--body-timeout", str(DEADLINE)]
GOOD = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
SLOW_CLIENTS = 16
SLOW_SECONDS = 3.0  # past DEADLINE: the slow clients are cut off meanwhile


@pytest.fixture(scope="module")
def server():
    with ServerProcess(CLI_ARGS) as process:
        yield process


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.settimeout(30)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one HTTP/1.1 response, read to its Content-Length or EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    text = body[:length].decode() if length >= 0 else body.decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """(status, headers with lower-case names) of a response's head."""
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers


def raw_post(server, body: bytes, extra_headers: str = "") -> tuple[int, dict | str]:
    with connect(server) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n{extra_headers}\r\n".encode() + body)
        return read_response(sock)


def assert_error(answer, status: int, code: str) -> None:
    got, body = answer
    assert got == status and isinstance(body, dict), answer
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body


def assert_serving(server) -> None:
    status, body = server.request("POST", "/v1/completions", GOOD)
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_garbage_and_truncated_bodies_get_400(server):
    rng = random.Random(20)
    for _ in range(5):
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
        status, body = raw_post(server, garbage)
        assert status == 400 and body["error"]["code"] in ("invalid_encoding", "invalid_json"), body
    printable = "".join(rng.choice("{}[]:,\"'abc123 \\\n") for _ in range(500)).encode()
    assert_error(raw_post(server, printable), 400, "invalid_json")
    full = json.dumps({**GOOD, "stop": ["x"] * 3}).encode()
    for cut in (1, len(full) // 2, len(full) - 1):
        assert_error(raw_post(server, full[:cut]), 400, "invalid_json")
    assert_error(raw_post(server, b"[" * 10_000), 400, "json_too_deep")
    assert_serving(server)


def test_huge_bodies_get_413_without_being_read(server):
    with connect(server) as sock:  # declared: refused from the header, the body is never sent
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        assert_error(read_response(sock), 413, "request_too_large")
    with connect(server) as sock:  # chunked, no length: refused once the bytes pass the limit
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        chunk = b"a" * 16384
        try:
            while sent <= 2 * BODY_LIMIT:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
        except OSError:  # the server answered and closed before we were done: fine
            pass
        assert_error(read_response(sock), 413, "request_too_large")
    assert_serving(server)


def test_bytes_that_are_not_http_and_a_header_bomb_close_the_connection(server):
    for junk in (b"\x00\xff\xfe not http at all\r\n\r\n", b"BREW /pot-0 HTCPCP/1.0\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bomb: " + b"a" * 200_000 + b"\r\n\r\n"):
        with connect(server) as sock:
            try:
                sock.sendall(junk)
                status, _ = read_response(sock)
            except (ConnectionResetError, BrokenPipeError):
                continue  # closed on us before it had all of it: fine too
            assert 400 <= status < 500, status
    assert_serving(server)


def test_slow_loris_clients_do_not_stop_correct_requests(server):
    stop = threading.Event()
    sockets: list[socket.socket] = []

    def drip(sock: socket.socket, request: bytes) -> None:
        try:
            for byte in request:
                if stop.wait(SLOW_SECONDS / len(request)):
                    return
                sock.send(bytes([byte]))
        except OSError:
            pass

    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n"
    threads = []
    for i in range(SLOW_CLIENTS):
        sock = connect(server)
        sockets.append(sock)
        if i % 2:  # headers whole, a body that never completes
            sock.sendall(request + b"\r\n" + b'{"prompt": ')
        else:
            threads.append(threading.Thread(target=drip, args=(sock, request), daemon=True))
            threads[-1].start()
    try:
        started = time.monotonic()
        while time.monotonic() - started < SLOW_SECONDS:  # served all along (each within the client's timeout)
            assert_serving(server)
    finally:
        stop.set()
        for sock in sockets:
            sock.close()
        for thread in threads:
            thread.join(5)
    assert server.process.poll() is None
    assert_serving(server)
    deadline = time.monotonic() + 30
    while True:
        status, text = server.request("GET", "/metrics")
        usage = [line for line in text.splitlines() if line.startswith("blockserve_kv_cache_usage_ratio")]
        if all(line.endswith(" 0.0") for line in usage) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert usage and all(line.endswith(" 0.0") for line in usage), usage


def read_until_closed(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """(when the server closed `sock`, on time.monotonic's clock; all it sent before); fails past
    `limit` seconds."""
    data = b""
    sock.settimeout(limit)
    while chunk := sock.recv(65536):
        data += chunk
    return time.monotonic(), data


def parse_response(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert headers.get("connection", "").lower() == "close", headers
    return status, json.loads(body)


def test_slow_clients_are_cut_off_at_their_deadlines(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n"
    good = json.dumps(GOOD).encode()
    request = head.replace(b"40", str(len(good)).encode()) + b"\r\n" + good
    opened = time.monotonic()
    with connect(server) as silent, connect(server) as half_head, connect(server) as half_body, \
            connect(server) as kept:
        half_head.sendall(head[:30])  # a head that never ends
        half_body.sendall(head + b"\r\n" + b'{"prompt": ')  # a body that never ends
        kept.sendall(request)  # served, then the next request's head never ends
        assert read_response(kept)[0] == 200
        served = time.monotonic()
        kept.sendall(head[:30])
        closed = {name: read_until_closed(sock, DEADLINE + 10)
                  for name, sock in (("silent", silent), ("half_head", half_head), ("half_body", half_body),
                                     ("kept", kept))}
    since = {name: at - (served if name == "kept" else opened) for name, (at, _) in closed.items()}
    assert all(0.9 * DEADLINE < seconds < DEADLINE + 5 for seconds in since.values()), since
    assert closed["silent"][1] == b"", closed  # nothing asked, nothing answered: closed as an idle keep-alive
    for name, code in (("half_head", "header_timeout"), ("half_body", "body_timeout"), ("kept", "header_timeout")):
        assert_error(parse_response(closed[name][1]), 408, code)
    assert_serving(server)
