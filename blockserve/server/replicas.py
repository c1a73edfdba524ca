"""The engine replicas behind `blockserve serve --data-parallel-size N`: each a plain
`blockserve serve` subprocess on its own loopback port, with the front end's engine and server
flags (API keys through the environment, never argv), started together and stopped with SIGTERM
(which drains each one). A replica is sent SIGTERM too when the front end dies without
stopping it (Linux: the parent-death signal), so none outlives it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from blockserve.config_args import cli_fields, flag_name
from blockserve.engine.config import EngineConfig
from blockserve.server.config import ServerConfig

logger = logging.getLogger("blockserve.server")

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # prctl(2)
_KILL_GRACE_S = 10  # after a replica's own drain: how long it may take to exit before it is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def config_flags(config) -> list[str]:
    """The command-line flags that rebuild dataclass `config`: one per field whose value is not its default."""
    flags: list[str] = []
    for f in cli_fields(type(config)):
        value = getattr(config, f.name)
        if value == f.default or value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag_name(f))  # a switch: given only to flip its default
        elif isinstance(value, tuple):
            for item in value:
                flags += [flag_name(f), str(item)]
        else:
            flags += [flag_name(f), repr(value) if isinstance(value, float) else str(value)]
    return flags


@dataclass
class ReplicaProcess:
    index: int
    port: int
    process: subprocess.Popen

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> bool:
        return self.process.poll() is not None


def replica_command(engine_config: EngineConfig, server_config: ServerConfig, port: int, quiet: bool) -> list[str]:
    replica = dataclasses.replace(server_config, host=LOOPBACK, port=port, data_parallel_size=1, api_keys=())
    return [sys.executable, "-m", "blockserve.cli", *(["-q"] if quiet else []), "serve",
            *config_flags(replica), *config_flags(engine_config)]


def start_replicas(engine_config: EngineConfig, server_config: ServerConfig, *, quiet: bool = False,
                   startup_timeout: float = 600.0) -> list[ReplicaProcess]:
    """Start `server_config.data_parallel_size` replicas and wait until each answers /health;
    RuntimeError (every replica stopped) if one exits or is not healthy in `startup_timeout` s."""
    env = {**os.environ, "BLOCKSERVE_API_KEY": ",".join(server_config.api_keys)}
    replicas = []
    for index in range(server_config.data_parallel_size):
        port = free_port()
        command = replica_command(engine_config, server_config, port, quiet)
        replicas.append(ReplicaProcess(index, port, subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                                                     preexec_fn=_ended_with(os.getpid()))))
    try:
        _wait_healthy(replicas, startup_timeout)
    except BaseException:
        stop_replicas(replicas, timeout=0)
        raise
    return replicas


def _ended_with(parent: int):
    """For Popen's preexec_fn: on Linux the child is sent SIGTERM (so it drains and exits) when
    `parent`, the front end, dies however it dies, SIGKILL included; no replica outlives it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, only called after it

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the front end died before the line above: nobody would signal it
            os._exit(1)

    return in_child


def _wait_healthy(replicas: list[ReplicaProcess], timeout: float) -> None:
    pending = list(replicas)
    deadline = time.monotonic() + timeout
    while pending:
        for replica in list(pending):
            if replica.exited():
                raise RuntimeError(f"replica {replica.index} exited with {replica.process.returncode} while starting "
                                   "(its log is above)")
            try:
                with urllib.request.urlopen(f"{replica.base_url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        pending.remove(replica)
                        logger.info("replica %d ready on port %d (pid %d)", replica.index, replica.port, replica.pid)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {[r.index for r in pending]} not healthy after {timeout} s "
                               "(raise --dp-startup-timeout for a slow model load)")
        if pending:
            time.sleep(0.25)


def stop_replicas(replicas: list[ReplicaProcess], timeout: float) -> None:
    """SIGTERM every live replica (each drains for up to its --shutdown-timeout), wait up to
    `timeout` + a grace for them to exit, then kill the rest."""
    for replica in replicas:
        if not replica.exited():
            replica.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout + _KILL_GRACE_S
    for replica in replicas:
        try:
            replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("replica %d did not exit after SIGTERM; killing it", replica.index)
            replica.process.kill()
            replica.process.wait()
