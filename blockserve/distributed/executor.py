"""Rank 0 of a tensor-parallel engine: starts (or waits for) ranks 1..N-1, loads its own shard, and
runs each step on every rank; only rank 0 samples.

    engine process: scheduler, KV manager (torch-free, unchanged), rank 0
        │  broadcast SchedulerOutput (gloo, CPU)        ranks 1..N-1 (distributed/worker.py):
        ├──────────────────────────────────────────►    the same forward, all-reduces inside
        ▼                                               (spawned here, or by torchrun / any
    ModelRunner.execute: forward ─► logits gathered     launcher setting env://)
    to rank 0 ─► sampler ─► ModelRunnerOutput

A second prefix-cache tier (`kv_offload_dir`): at start-up every rank fingerprints its own shard
and checks it sees the directory rank 0 does (a marker file rank 0 writes there); rank 0 gathers the
fingerprints, so its store (the scheduler's) keys a block by every rank's entry and reads and
verifies them all before a hit is granted. A step's loads carry one payload per rank: rank 0 keeps
its own and sends the others (`_for_ranks`); each rank writes its own entries of the save orders.
A rank whose writes stop (disk full or failing) posts it in the group's store once; rank 0 reads
that at steps that order saves (at most every WRITES_POLL_S) and stops ordering them. Each rank's
writer also posts its counts (writes, bytes, failed and dropped ones) there, at most once a second
while they change, and rank 0's store adds them to its stats (`rank_writer_counts`, read from the
group's store at most every WRITES_POLL_S): no collective.

The KV cache plan uses the smallest KV memory budget of any rank (every rank holds the same
shapes: its heads are 1/N of the model's, or one replicated KV head), so the capacity is the
minimum over ranks.

Faults: a rank that raises or dies fails the step in progress at once (its connections close),
one that hangs within `distributed_timeout_s`; the executor then stops every rank and raises
EngineDead naming the rank and its error, which the engine hands to every request (the server
answers 503), and every later step raises it again. Start-up waits at most
`distributed_startup_timeout_s`. `close()` (also run when the executor is garbage-collected or
the interpreter exits) stops the ranks and leaves no process behind. The ranks it starts are
`python -m blockserve.distributed.worker` processes (rank_process.py), which never import the
engine's `__main__`; one that exits before it joins fails the start at once with RankExited,
naming the rank, its exit status and the end of its stderr; one that exits while joining, within
`distributed_timeout_s`, with the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
import weakref
from datetime import timedelta

import torch

from blockserve.distributed.rank_process import LOOPBACK, RankExited, RankProcess, wait_until_joining
from blockserve.errors import EngineDead
from blockserve.tensor_parallel.group import TensorParallelGroup

logger = logging.getLogger("blockserve")

_JOIN_S = 10.0  # how long a stopped rank may take to exit before it is killed
_REPORT_WAIT_S = 3.0  # after a failure rank 0 saw as torch's error: how long a failing rank may take to exit
WRITES_POLL_S = 1.0  # at steps ordering saves, how often rank 0 asks whether a rank's disk-tier writes stopped


def writes_stopped_topic(marker: str) -> str:
    """Where a rank posts (TensorParallelGroup.post) that its disk-tier writes stopped; `marker` (rank 0's
    start-up marker file, unique to this engine) keeps engines sharing a launcher's store apart."""
    return f"kv-writes-stopped/{marker}"


def writer_counts_topic(marker: str) -> str:
    """Where a rank posts its disk-tier writer's counts (as `counts_text` writes them)."""
    return f"kv-writer-counts/{marker}"


def counts_text(counts) -> str:
    """A rank's WriterCounts, as posted."""
    return json.dumps(dataclasses.asdict(counts))


def _counts_from_text(text: str):
    from blockserve.kv.tiers import WriterCounts

    fields = json.loads(text)
    return WriterCounts(**{name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
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
        self._ranks: list[RankProcess] = []
        self._dead: EngineDead | None = None
        self._serving = [False]  # the ranks are in their step loop (they leave it on a None step)
        self.runner = None
        self.rank_fingerprints: tuple[bytes, ...] | None = None  # every rank's, with kv_offload_dir
        self._writes_topic: str | None = None  # where ranks post that their writes stopped (kv_offload_dir)
        self._writes_polled = float("-inf")  # when rank 0 last read it
        self._counts_topic: str | None = None  # where ranks post their writers' counts (kv_offload_dir)
        self._counts_polled = float("-inf")
        self._rank_counts: list = []  # ranks 1..N-1's WriterCounts, as last read
        if config.distributed_executor == "spawn":
            self.group = self._start_ranks(config.distributed_startup_timeout_s)
        else:
            self.group = TensorParallelGroup("env://", timeout=self._startup)
            if self.group.rank != 0 or self.group.size != self.size:
                raise ValueError(f"the engine must be rank 0 of {self.size} (tensor_parallel_size); the launcher "
                                 f"gave RANK={self.group.rank}, WORLD_SIZE={self.group.size}")
        self._finalizer = weakref.finalize(self, _stop, self.group, self._ranks, self._serving)
        try:
            self.group.broadcast_object(config)
            self.group.timeout = timedelta(seconds=config.distributed_timeout_s)
            self.loaded = load_model(config.model, BACKENDS[config.attention_backend],
                                     quantized_matmul=config.quantized_matmul,
                                     quantized_activations=config.quantized_activations,
                                     quantized_max_rows=config.quantized_max_rows,
                                     placement=Placement(tp=self.group, keep_16bit_weights=config.dtype == "auto"))
            reports = self.group.gather_objects(("ok", config.kv_cache_bytes()), timeout=self._startup)
            self._raise_failed(reports, "load its shard")
            self.kv_memory_bytes = min(memory for _, memory in reports)
        except BaseException as error:
            exited = self._exited_rank(error)
            self.close()
            if exited is not None:
                raise exited.start_up_failure() from error
            raise
        logger.info("tensor parallel: %d ranks (%s), KV budget %.1f MiB per rank (the smallest of any rank)",
                    self.size, config.distributed_executor, self.kv_memory_bytes / 2**20)

    def _start_ranks(self, startup_timeout_s: float) -> TensorParallelGroup:
        """Start ranks 1..N-1 and join them as rank 0; on any failure none of them stays."""
        port = _free_port()
        try:
            for rank in range(1, self.size):
                self._ranks.append(RankProcess(rank, self.size, port))
            wait_until_joining(self._ranks, startup_timeout_s)
            # Every rank has imported what it runs and is joining: forming the group is communication
            # like a step's, bounded as one is, so a rank that dies in between (torch's rendezvous
            # is deaf to its exit) fails the start within distributed_timeout_s, not the start-up timeout.
            return TensorParallelGroup(f"tcp://{LOOPBACK}:{port}", 0, self.size,
                                       timeout=timedelta(seconds=self.config.distributed_timeout_s))
        except BaseException as error:
            exited = None if isinstance(error, RankExited) else self._exited_rank(error)
            for rank in self._ranks:
                rank.stop(0)
            if exited is not None:  # rank 0's view of the rank's exit: the rank's own error instead
                raise exited.start_up_failure() from error
            raise

    def start(self, kv_config, max_num_seqs: int, max_model_len: int, seed: int | None, dtype=None,
              offload_sizes: tuple[int, int] | None = None):
        """Every rank builds its ModelRunner over `kv_config` (checking its own KV specs equal rank 0's)
        and, given `offload_sizes` (kv_offload_dir: the writer queue's bytes and the disk cap), its
        second-tier store; `rank_fingerprints` then holds every rank's fingerprint (of its shard in
        `dtype`, rank 0's). Returns self, the runner the engine steps."""
        from blockserve.worker.model_runner import ModelRunner

        try:
            self.group.broadcast_object((kv_config, max_num_seqs, max_model_len), timeout=self._startup)
            self._raise_failed(self.group.gather_objects(("ok", None), timeout=self._startup), "set up its KV cache")
            self.runner = ModelRunner(self.loaded.model, kv_config, max_num_seqs, max_model_len, seed, device="cpu")
            if offload_sizes is not None:
                self.rank_fingerprints = self._share_offload(kv_config, dtype, offload_sizes)
        except BaseException as error:
            exited = self._exited_rank(error)
            self.close()
            if exited is not None:
                raise exited.start_up_failure() from error
            raise
        self._serving[0] = True
        return self

    def _share_offload(self, kv_config, dtype, sizes: tuple[int, int]) -> tuple[bytes, ...]:
        """Every rank's fingerprint, once each has checked it sees rank 0's directory and set up its tiers;
        sent to every rank, whose store then takes the save orders. ValueError naming a rank that cannot."""
        from blockserve.worker.kv_fingerprint import model_fingerprint

        directory = self.config.kv_offload_dir
        marker = f".tp-{uuid.uuid4().hex}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, marker), "wb"):
                pass
        except OSError as e:
            raise ValueError(f"--kv-offload-dir {directory!r} cannot be used: {e.strerror or e}; give a directory "
                             "this process can create and write") from e
        try:
            self.group.broadcast_object((dtype, marker, sizes), timeout=self._startup)
            own = model_fingerprint(self.loaded.model, self.config, kv_config, dtype, 0, self.size)
            reports = self.group.gather_objects(("ok", own), timeout=self._startup)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, marker))
        self._raise_failed(reports, "use --kv-offload-dir")
        self._writes_topic = writes_stopped_topic(marker)
        self._counts_topic = writer_counts_topic(marker)
        fingerprints = tuple(fingerprint for _, fingerprint in reports)
        self.group.broadcast_object(fingerprints, timeout=self._startup)
        return fingerprints

    def _for_ranks(self, scheduler_output):
        """(rank 0's step, the step sent to the others): a load's payloads are one per rank (rank 0's store
        reads every rank's entry); rank 0 keeps its own and sends ranks 1..N-1 theirs."""
        loads = scheduler_output.blocks_to_load
        if not loads:
            return scheduler_output, scheduler_output
        own = {g: [(block, payloads[0]) for block, payloads in group] for g, group in loads.items()}
        others = {g: [(block, payloads[1:]) for block, payloads in group] for g, group in loads.items()}
        return (dataclasses.replace(scheduler_output, blocks_to_load=own),
                dataclasses.replace(scheduler_output, blocks_to_load=others))

    @property
    def processes(self) -> tuple:
        """The ranks this engine started (subprocess.Popen, rank 1 first); none when external."""
        return tuple(rank.process for rank in self._ranks)

    @property
    def timings(self):
        return self.runner.timings

    def execute(self, scheduler_output):
        """The step on every rank; rank 0's ModelRunnerOutput. EngineDead once any rank failed."""
        if self._dead is not None:
            raise self._dead
        lost = [rank for rank in self._ranks if rank.exited()]
        try:
            if lost:
                raise RuntimeError(f"rank {lost[0].rank} exited with status {lost[0].process.returncode}")
            if scheduler_output.blocks_to_save:
                self._check_rank_writes()
            own, others = self._for_ranks(scheduler_output)
            self.group.broadcast_object(others)
            return self.runner.execute(own)
        except Exception as error:
            self._serving[0] = False  # the ranks are mid-step or gone: closing the group ends them
            self._dead = EngineDead(f"tensor-parallel step failed ({self._cause(error)}); the engine has stopped")
            logger.error("%s", self._dead)
            self.close()
            raise self._dead from error

    def _check_rank_writes(self) -> None:
        """At most every WRITES_POLL_S: if a rank posted that its disk-tier writes stopped, turn rank 0's
        store's writes off (one warning naming the rank): a block is held only once every rank's entry is
        written, so no save can complete any more, while the blocks every rank holds are still read."""
        store = self.runner.offload
        now = time.monotonic()
        if self._writes_topic is None or store is None or not store.writing:
            return
        if now - self._writes_polled < WRITES_POLL_S:
            return
        self._writes_polled = now
        if stopped := self.group.posts(self._writes_topic):
            rank, why = min(stopped.items())
            store.stop_writing(f"tensor-parallel rank {rank} can no longer write its entries ({why}), and a block "
                               "needs every rank's")

    def rank_writer_counts(self) -> list:
        """Ranks 1..N-1's disk-tier WriterCounts as each last posted them (within about a second of its
        writes), read from the group's store at most every WRITES_POLL_S (rank 0's store's `peers`)."""
        now = time.monotonic()
        if self._counts_topic is not None and self._finalizer.alive and now - self._counts_polled >= WRITES_POLL_S:
            self._counts_polled = now
            posted = self.group.posts(self._counts_topic)
            self._rank_counts = [_counts_from_text(text) for _, text in sorted(posted.items())]
        return self._rank_counts

    def _cause(self, error: Exception) -> str:
        """A rank's own report of what went wrong (the error it exited with), if one has, else rank 0's view."""
        exited = self._exited_rank(error)
        report = exited.report() if exited is not None else None
        return report or f"{type(error).__name__}: {error}"

    def _exited_rank(self, error: BaseException) -> RankProcess | None:
        """The first started rank that has exited with an error; after one of torch's errors (a
        peer's connection closed: that rank is on its way out), waiting up to _REPORT_WAIT_S for it."""
        deadline = time.monotonic() + (_REPORT_WAIT_S if isinstance(error, RuntimeError) else 0)
        while self._ranks:
            exited = next((rank for rank in self._ranks if rank.exited() and rank.process.returncode != 0), None)
            if exited is not None or time.monotonic() >= deadline:
                return exited
            time.sleep(0.05)
        return None

    def _raise_failed(self, reports: list, what: str) -> None:
        failed = [(rank, detail) for rank, (status, detail) in enumerate(reports) if status != "ok"]
        if failed:
            rank, detail = failed[0]
            raise ValueError(f"tensor-parallel rank {rank} could not {what}: {detail}")

    def close(self) -> None:
        """Stop every rank (idempotent); no process is left."""
        self._finalizer()


def _stop(group: TensorParallelGroup, ranks: list[RankProcess], serving: list[bool]) -> None:
    """Tell the ranks to leave (a None step) if they are serving, close the group (which fails
    whatever a rank waits for), and reap the started processes."""
    if serving[0] and not any(rank.exited() for rank in ranks):
        try:
            group.broadcast_object(None, timeout=timedelta(seconds=5))
        except Exception:  # a rank already gone: closing the group below ends the others
            pass
    group.close()
    for rank in ranks:
        rank.stop(_JOIN_S)
