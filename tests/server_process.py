"""The real `blockserve serve` in a subprocess on a free loopback port, stopped however a test ends.

    with ServerProcess(["--max-model-len", "512"]) as server:   # returns once /health answers 200
        status, body = server.request("GET", "/v1/models")
    # stopped (SIGTERM, then SIGKILL), its log removed

`ServerProcess(args, healthy=False)` returns while the server still loads (call `wait_healthy()`).
`free_port()` is the one way tests pick a loopback port (servers, gloo ranks).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blockserve_command() -> list[str]:
    script = Path(sys.executable).parent / "blockserve"
    if script.exists():
        return [str(script)]
    found = shutil.which("blockserve")
    return [found] if found else [sys.executable, "-m", "blockserve.cli"]


class ServerProcess:
    """`blockserve serve ARGS --port <a free port>`, started on construction, its output in a log file.
    As a context manager: entered once healthy (unless `healthy=False`), left stopped with its log
    removed."""

    def __init__(self, args: list[str], *, healthy: bool = True):
        self.port = free_port()
        self.healthy = healthy
        fd, self.log_path = tempfile.mkstemp(prefix="blockserve-serve-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.process = subprocess.Popen([*blockserve_command(), "serve", "--port", str(self.port), *args],
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def __enter__(self) -> ServerProcess:
        if self.healthy:
            try:
                self.wait_healthy()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                key: str | None = None, headers: dict | None = None) -> tuple[int, dict | str | None]:
        """One raw HTTP request: (status, parsed JSON body, or the text if it is not JSON)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            all_headers = {"Content-Type": "application/json", **(headers or {})}
            if key is not None:
                all_headers["Authorization"] = f"Bearer {key}"
            if isinstance(body, dict):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            text = response.read().decode()
            try:
                return response.status, json.loads(text) if text else None
            except json.JSONDecodeError:
                return response.status, text
        finally:
            conn.close()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"blockserve serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"blockserve serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after 15 s; nothing if it has exited."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    def close(self) -> None:
        """Stopped, its log removed."""
        try:
            self.stop()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log_path)
