"""The real `blockserve serve` in a subprocess on a free loopback port, killed however a test ends."""

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
from dataclasses import dataclass
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


@dataclass
class ServerProcess:
    port: int
    process: subprocess.Popen
    log_path: str

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
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    def log_cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)


def start_server(args: list[str]) -> ServerProcess:
    """Start `blockserve serve ARGS` (not yet healthy: call wait_healthy); the caller must stop() it."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="blockserve-serve-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        process = subprocess.Popen([*blockserve_command(), "serve", "--port", str(port), *args],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return ServerProcess(port, process, log_path)


@contextlib.contextmanager
def healthy_server(args: list[str]):
    """A started and healthy `blockserve serve ARGS`, stopped (its log removed) however the block ends."""
    proc = start_server(args)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()
        proc.log_cleanup()
