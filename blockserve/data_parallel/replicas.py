"""The engine replicas behind `blockserve serve --data-parallel-size N`: each a plain
`blockserve serve` subprocess on its own loopback port, with the front end's engine and server
flags (API keys through the environment, never argv), started together and stopped with SIGTERM
(which drains each one). A replica is sent SIGTERM too when the front end dies without
stopping it (Linux: the parent-death signal), so none outlives it.

On CUDA each replica runs on a GPU of its own, as vLLM's data-parallel ranks do: replica i sees only
the i-th GPU visible to the front end (CUDA_VISIBLE_DEVICES, or every GPU of the host), as its
cuda:0. Fewer GPUs than replicas is an error at start-up: replicas sharing one GPU would each size
their KV cache from the memory the others had left free.
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


def replica_environments(engine_config: EngineConfig, replicas: int, environ=os.environ,
                         cuda_devices: int | None = None) -> list[dict[str, str]]:
    """What each replica's environment adds to the front end's to give it its device: on CUDA, its
    own GPU (CUDA_VISIBLE_DEVICES); nothing on the CPU. ValueError if the GPUs are too few, or the
    device names one GPU for all. `cuda_devices`: the GPUs torch sees (given by tests)."""
    device = engine_config.device
    if device == "cpu" or engine_config.tensor_parallel_size > 1:  # tensor parallelism runs on the CPU
        return [{} for _ in range(replicas)]
    if device.startswith("cuda:"):
        raise ValueError(f"--data-parallel-size {replicas} gives each replica a GPU of its own, so --device "
                         f"{device} (one GPU for all) cannot be honoured: pass --device cuda (or auto), and choose "
                         "the GPUs with CUDA_VISIBLE_DEVICES")
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_devices == 0:
        if device == "cuda":
            raise ValueError("--device cuda, but CUDA is not available here: use --device cpu or auto")
        return [{} for _ in range(replicas)]  # auto on a host without CUDA: the CPU
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in listed.split(",")][:cuda_devices] if listed else [str(i) for i in range(cuda_devices)]
    if len(visible) < replicas:
        shown = f" (CUDA_VISIBLE_DEVICES={listed})" if listed else ""
        raise ValueError(f"--data-parallel-size {replicas} needs a GPU per replica, but {len(visible)} "
                         f"{'is' if len(visible) == 1 else 'are'} visible{shown}: run fewer replicas, or --device cpu")
    return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in visible[:replicas]]


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
    devices = replica_environments(engine_config, server_config.data_parallel_size)
    replicas = []
    for index, device in enumerate(devices):
        port = free_port()
        command = replica_command(engine_config, server_config, port, quiet)
        if device:
            logger.info("replica %d: %s", index, " ".join(f"{k}={v}" for k, v in device.items()))
        replicas.append(ReplicaProcess(index, port, subprocess.Popen(command, env={**env, **device},
                                                                     stdin=subprocess.DEVNULL,
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
