"""Rank 0 of a tensor-parallel engine: starts (or waits for) ranks 1..N-1, loads its own shard, and
runs each step on every rank; only rank 0 samples.

    engine process: scheduler, KV manager (torch-free, unchanged), rank 0
        │  broadcast SchedulerOutput (gloo, CPU)        ranks 1..N-1 (distributed/worker.py):
        ├──────────────────────────────────────────►    the same forward, all-reduces inside
        ▼                                               (spawned here, or by torchrun / any
    ModelRunner.execute: forward ─► logits gathered     launcher setting env://)
    to rank 0 ─► sampler ─► ModelRunnerOutput

The KV cache plan uses the smallest KV memory budget of any rank (every rank holds the same
shapes: its heads are 1/N of the model's, or one replicated KV head), so the capacity is the
minimum over ranks.

Faults: a rank that raises or dies fails the step in progress at once (its connections close),
one that hangs within `distributed_timeout_s`; the executor then stops every rank and raises
EngineDead naming the rank and its error, which the engine hands to every request (the server
answers 503), and every later step raises it again. Start-up waits at most
`distributed_startup_timeout_s`. `close()` (also run when the executor is garbage-collected or
the interpreter exits) stops the ranks and leaves no process behind.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import weakref
from datetime import timedelta

import torch

from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.distributed.worker import spawned_worker
from blockserve.errors import EngineDead

logger = logging.getLogger("blockserve")

_JOIN_S = 10.0  # how long a stopped rank may take to exit before it is killed


def _worker_context():
    """Processes started from a fork server that has imported the worker's modules once: the first
    engine pays for the imports (seconds), later ones start in milliseconds. Each rank is forked
    from that single-threaded server, never from the engine (whose torch threads fork must not copy)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["blockserve.distributed.worker", "blockserve.models.loader",
                                    "blockserve.worker.model_runner"])
    return context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """`TensorParallelExecutor(config)`: ranks up, rank 0's shard loaded (`loaded`) and the KV
    budget for the plan known (`kv_memory_bytes`); `start(kv_config, ...)` builds the runner on
    every rank, after which `execute(scheduler_output)` and `timings` stand in for a ModelRunner's."""

    def __init__(self, config, loaded=None):
        from blockserve.attention.paged_attention import BACKENDS
        from blockserve.models.loader import check_tensor_parallel, load_model
        from blockserve.models.placement import Placement

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if loaded is not None:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} loads each rank's shard itself: "
                             "pass the model's path, not an already loaded model")
        check_tensor_parallel(config.model, config.tensor_parallel_size)
        self.config = config
        self.size = config.tensor_parallel_size
        self._startup = timedelta(seconds=config.distributed_startup_timeout_s)
        self._processes: list = []
        self._pipes: list = []
        self._dead: EngineDead | None = None
        self._serving = [False]  # the ranks are in their step loop (they leave it on a None step)
        self.runner = None
        if config.distributed_executor == "spawn":
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            context = _worker_context()
            for rank in range(1, self.size):
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=spawned_worker, name=f"blockserve-tp-rank{rank}", daemon=True,
                                          args=(rank, self.size, init_method, config.distributed_startup_timeout_s,
                                                sender))
                process.start()
                sender.close()
                self._processes.append(process)
                self._pipes.append(receiver)
            try:
                self.group = TensorParallelGroup(init_method, 0, self.size, timeout=self._startup)
            except BaseException:  # the ranks did not all join in time: none of them stays
                for process in self._processes:
                    process.kill()
                    process.join()
                raise
        else:
            self.group = TensorParallelGroup("env://", timeout=self._startup)
            if self.group.rank != 0 or self.group.size != self.size:
                raise ValueError(f"the engine must be rank 0 of {self.size} (tensor_parallel_size); the launcher "
                                 f"gave RANK={self.group.rank}, WORLD_SIZE={self.group.size}")
        self._finalizer = weakref.finalize(self, _stop, self.group, self._processes, self._serving)
        try:
            self.group.broadcast_object(config)
            self.group.timeout = timedelta(seconds=config.distributed_timeout_s)
            self.loaded = load_model(config.model, BACKENDS[config.attention_backend],
                                     quantized_matmul=config.quantized_matmul,
                                     quantized_activations=config.quantized_activations,
                                     quantized_max_rows=config.quantized_max_rows, placement=Placement(tp=self.group))
            reports = self.group.gather_objects(("ok", config.kv_cache_bytes()), timeout=self._startup)
            self._raise_failed(reports, "load its shard")
            self.kv_memory_bytes = min(memory for _, memory in reports)
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks (%s), KV budget %.1f MiB per rank (the smallest of any rank)",
                    self.size, config.distributed_executor, self.kv_memory_bytes / 2**20)

    def start(self, kv_config, max_num_seqs: int, max_model_len: int, seed: int | None):
        """Every rank builds its ModelRunner over `kv_config` (checking its own KV specs equal rank 0's);
        returns self, the runner the engine steps."""
        from blockserve.worker.model_runner import ModelRunner

        try:
            self.group.broadcast_object((kv_config, max_num_seqs, max_model_len), timeout=self._startup)
            self._raise_failed(self.group.gather_objects(("ok", None), timeout=self._startup), "set up its KV cache")
            self.runner = ModelRunner(self.loaded.model, kv_config, max_num_seqs, max_model_len, seed, device="cpu")
        except BaseException:
            self.close()
            raise
        self._serving[0] = True
        return self

    @property
    def processes(self) -> tuple:
        """The ranks this engine spawned (multiprocessing.Process, rank 1 first); none when external."""
        return tuple(self._processes)

    @property
    def timings(self):
        return self.runner.timings

    def execute(self, scheduler_output):
        """The step on every rank; rank 0's ModelRunnerOutput. EngineDead once any rank failed."""
        if self._dead is not None:
            raise self._dead
        lost = [p for p in self._processes if not p.is_alive()]
        try:
            if lost:
                raise RuntimeError(f"{lost[0].name} exited with status {lost[0].exitcode}")
            self.group.broadcast_object(scheduler_output)
            return self.runner.execute(scheduler_output)
        except Exception as error:
            self._serving[0] = False  # the ranks are mid-step or gone: closing the group ends them
            self._dead = EngineDead(f"tensor-parallel step failed ({self._cause(error)}); the engine has stopped")
            logger.error("%s", self._dead)
            self.close()
            raise self._dead from error

    def _cause(self, error: Exception) -> str:
        """A rank's own report of what went wrong, if one sent it, else rank 0's view."""
        for pipe in self._pipes:
            try:
                if pipe.poll(1.0):
                    return pipe.recv()
            except (EOFError, OSError):
                continue
        return f"{type(error).__name__}: {error}"

    def _raise_failed(self, reports: list, what: str) -> None:
        failed = [(rank, detail) for rank, (status, detail) in enumerate(reports) if status != "ok"]
        if failed:
            rank, detail = failed[0]
            raise ValueError(f"tensor-parallel rank {rank} could not {what}: {detail}")

    def close(self) -> None:
        """Stop every rank (idempotent); no process is left."""
        self._finalizer()


def _stop(group: TensorParallelGroup, processes: list, serving: list[bool]) -> None:
    """Tell the ranks to leave (a None step) if they are serving, close the group (which fails
    whatever a rank waits for), and reap the spawned processes."""
    if serving[0] and all(p.is_alive() for p in processes):
        try:
            group.broadcast_object(None, timeout=timedelta(seconds=5))
        except Exception:  # a rank already gone: closing the group below ends the others
            pass
    group.close()
    for process in processes:
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join()
