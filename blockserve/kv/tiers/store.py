"""The second tier of the prefix cache: host memory and/or disk behind the device pool.

    scheduler's thread                          worker                     writer thread
    num_held(keys)      how far a prefix goes
    prefetch(keys)      read them on the loader thread while the request waits; True once read
    load(keys)          verified payloads  ──►  load orders (C2)
    claim(key)          a save order wanted? ─► save orders: copy the ─► submit ─► queue ─► tiers
                                                block, never blocking      (bounded in bytes; full: skip)

Entries are keyed by `entry_key(fingerprint, group, salted block hash)` (kv/tiers/entry.py). A load
returns only payloads that passed their tier's check, in prefix order, stopping at the first block
no tier holds intact: the KV manager grants exactly those, and the tokens past them are computed
again. Writes run on one thread behind a queue bounded by the bytes it holds, so the step never
waits for a disk; a save that would overfill it is dropped (counted), and a full disk or a failing
file system turns writes off (with one warning) while loads go on.

Under tensor parallelism each rank holds its own heads' KV, so a block is one entry per rank, each
under its rank's fingerprint. The store is then built with every rank's fingerprint: `key` is the
tuple of the ranks' entry keys, a block is held only when every rank's entry is, and a load (on rank
0, which schedules) reads and verifies every rank's entry, returning them as a tuple (one payload per
rank), or nothing when any one is missing or damaged, so the ranks never disagree on a hit. Each
rank's own store writes that rank's entry (`rank`), from its own KV, on its own writer thread; a
block no rank can complete any more is never worth claiming, so rank 0's store is told (`stop_writing`)
when another rank's writes stop (distributed/executor.py). A rank's writer hands its counts
(`WriterCounts`) to `report` at most once a second while they change, and rank 0's `stats()` adds
the other ranks' counts as `peers` last returned them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from blockserve.kv.tiers.disk import TierFull
from blockserve.kv.tiers.entry import CorruptEntry, entry_key

logger = logging.getLogger("blockserve")

WRITER_NICENESS = 10  # added to the writer thread's nice value where SCHED_IDLE is missing
DEFAULT_QUEUE_BYTES = 256 << 20  # payloads waiting for the writer: 366 blocks of the bundled model
REPORT_EVERY_S = 1.0  # how often at most a writer hands its changed counts to `report`
_IDLE = object()  # the writer's queue had nothing for REPORT_EVERY_S


class Tier(Protocol):
    name: str

    def contains(self, key: bytes) -> bool: ...
    def read(self, key: bytes) -> bytearray | None: ...  # verified, or CorruptEntry
    def write(self, key: bytes, payload: bytes) -> bool: ...  # False: not written (held already, or too large)
    def close(self) -> None: ...  # idempotent

    @property
    def num_bytes(self) -> int: ...

    @property
    def num_entries(self) -> int: ...

    def usage(self) -> tuple[int, int]: ...  # (num_entries, num_bytes) at once


@dataclass(frozen=True)
class TierStats:
    """One tier, cumulative since start-up: blocks served intact (`hits`), blocks whose read
    failed its check or found the entry gone (`load_failures`), the bytes and seconds of the reads,
    blocks and bytes written and writes that failed (every rank's, under tensor parallelism), and
    what it holds now."""

    name: str
    hits: int
    load_failures: int
    bytes_loaded: int
    load_seconds: float
    writes: int
    bytes_written: int
    write_failures: int
    entries: int
    bytes_held: int


@dataclass(frozen=True)
class OffloadStats:
    """The tiers in lookup order; the saves (and their bytes) dropped because the writer's queue had
    no room for them (every rank's); the bytes queued now and the queue's bound (this process's
    writer: rank 0's under tensor parallelism); whether writes are on."""

    tiers: tuple[TierStats, ...]
    writes_dropped: int
    bytes_dropped: int
    queued_bytes: int
    queue_bytes: int
    writing: bool


@dataclass(frozen=True)
class WriterCounts:
    """One process's writes, cumulative: per tier (in lookup order) the blocks and bytes written and
    the writes that failed; the saves (and bytes) dropped for want of room in its queue."""

    writes: tuple[int, ...]
    bytes_written: tuple[int, ...]
    write_failures: tuple[int, ...]
    writes_dropped: int
    bytes_dropped: int


class _Counters:
    __slots__ = ("hits", "load_failures", "bytes_loaded", "load_seconds", "writes", "bytes_written",
                 "write_failures")

    def __init__(self):
        self.hits = self.load_failures = self.bytes_loaded = self.writes = self.bytes_written = 0
        self.write_failures = 0
        self.load_seconds = 0.0


Key = bytes | tuple[bytes, ...]  # one entry, or one per tensor-parallel rank
Payload = bytearray | tuple[bytearray, ...]


def _shards(key: Key) -> tuple[bytes, ...]:
    return key if isinstance(key, tuple) else (key,)


def _nbytes(payload: Payload | None) -> int:
    if payload is None:
        return 0
    return sum(len(p) for p in payload) if isinstance(payload, tuple) else len(payload)


class TieredKVStore:
    """`tiers` in lookup order (host memory before disk); `fingerprint` names the model and KV format:
    one (a single process), or a tuple of every tensor-parallel rank's, in rank order, of which this
    process writes entry `rank` of each key. `report`, if given, is called on the writer's thread with
    the writer's counts, at most every REPORT_EVERY_S while they change."""

    def __init__(self, tiers: Sequence[Tier], fingerprint: bytes | tuple[bytes, ...],
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, loader_thread: bool = True, rank: int = 0,
                 report: Callable[[WriterCounts], None] | None = None):
        if isinstance(fingerprint, tuple) and not 0 <= rank < len(fingerprint):
            raise ValueError(f"rank {rank} has no fingerprint among the {len(fingerprint)} given")
        if not isinstance(fingerprint, tuple) and rank != 0:
            raise ValueError(f"a store of one fingerprint is rank 0's, got rank {rank}")
        self.rank = rank
        if not tiers:
            raise ValueError("a tiered KV store needs at least one tier")
        if queue_bytes <= 0:
            raise ValueError(f"the writer's queue needs a positive size, got {queue_bytes} bytes")
        self.tiers = tuple(tiers)
        self.fingerprint = fingerprint
        self._counters = [_Counters() for _ in self.tiers]
        self._lock = threading.Lock()
        self._in_flight: set[bytes] = set()  # claimed, not yet written or dropped
        self._writes_dropped = self._bytes_dropped = 0
        self._writing = True
        self.stopped_why: str | None = None  # why writes were turned off (`stop_writing`)
        self.queue_bytes = queue_bytes
        self._queued_bytes = 0  # payloads submitted and not yet written (under _lock)
        self._queue: queue.Queue = queue.Queue()  # bounded by _queued_bytes
        self._report = report
        self._reported: WriterCounts | None = None  # what `report` was last given (the writer's thread)
        self.peers: Callable[[], Sequence[WriterCounts]] | None = None  # rank 0's: the other ranks' counts
        self._writer = threading.Thread(target=self._write_loop, name="blockserve-kv-writer", daemon=True)
        self._writer.start()
        # Reads started by `prefetch` (under _lock): key -> verified payload, or None (no tier holds it intact).
        self._fetched: OrderedDict[bytes, bytearray | None] = OrderedDict()
        self._fetched_bytes = 0
        self._fetching: set[bytes] = set()
        self._fetch_queue: queue.Queue = queue.Queue()
        self._loader = None  # without one, a prefetch is read at the next call (simulations: deterministic)
        if loader_thread:
            self._loader = threading.Thread(target=self._fetch_loop, name="blockserve-kv-loader", daemon=True)
            self._loader.start()

    def key(self, group_id: int, block_hash: bytes) -> Key:
        """The key of a group's block: its entry's, or a tuple of every rank's entry's (tensor parallel)."""
        if isinstance(self.fingerprint, tuple):
            return tuple(entry_key(f, group_id, block_hash) for f in self.fingerprint)
        return entry_key(self.fingerprint, group_id, block_hash)

    def _own(self, key: Key) -> bytes:
        """The entry of `key` this process writes."""
        return key[self.rank] if isinstance(key, tuple) else key

    def _held(self, key: Key) -> bool:
        return all(any(tier.contains(k) for tier in self.tiers) for k in _shards(key))

    # -- lookups and loads (the scheduler's thread) --------------------------------------------

    def num_held(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, some tier holds (not yet verified: see `load`)."""
        for i, key in enumerate(keys):
            if not self._held(key):
                return i
        return len(keys)

    def holds(self, key: bytes) -> bool:
        """Whether some tier holds `key` (every rank's entry of it; not yet verified)."""
        return self._held(key)

    def load(self, keys: Sequence[Key]) -> list[Payload]:
        """The verified payloads of `keys`, from the first, up to the first that no tier holds intact
        (for a tuple key: up to the first one of whose ranks' entries is missing or damaged); a
        prefetched key is taken from what its read left, the others are read now."""
        payloads = []
        for key in keys:
            with self._lock:
                fetched = key in self._fetched
                if fetched:
                    payload = self._fetched.pop(key)
                    self._fetched_bytes -= _nbytes(payload)
            if not fetched:
                payload = self._read(key)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def _read(self, key: Key) -> Payload | None:
        """The key's verified payload; a tuple key's: every rank's, or None as soon as one is not intact."""
        if not isinstance(key, tuple):
            return self._read_entry(key)
        payloads = []
        for shard in key:
            if (payload := self._read_entry(shard)) is None:
                return None
            payloads.append(payload)
        return tuple(payloads)

    def _read_entry(self, key: bytes) -> bytearray | None:
        """The entry's verified payload from the first tier holding it intact (copied into the tiers before
        that one), None if none does."""
        for i, tier in enumerate(self.tiers):
            began = time.perf_counter()
            try:
                payload = tier.read(key)
            except CorruptEntry as e:
                logger.warning("KV %s tier: entry %s failed its check (%s); recomputing it", tier.name,
                               key.hex()[:16], e)
                with self._lock:
                    self._counters[i].load_failures += 1
                continue
            if payload is None:
                continue
            with self._lock:
                counters = self._counters[i]
                counters.hits += 1
                counters.bytes_loaded += len(payload)
                counters.load_seconds += time.perf_counter() - began
            for earlier in self.tiers[:i]:
                earlier.write(key, payload)
            return payload
        return None

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start reading and verifying `keys` on the loader thread (those not read or being read yet), so
        that `load` takes them without touching a tier. What was read waits, bounded by the writer
        queue's size (the least recently read dropped: `load` reads those again)."""
        if self._loader is None:  # a simulation: what earlier calls asked for is read now
            while not self._fetch_queue.empty():
                self._fetch(self._fetch_queue.get_nowait())
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._fetched and k not in self._fetching]
            self._fetching.update(new)
        if new:
            self._fetch_queue.put(new)

    def reading(self, keys: Sequence[bytes]) -> bool:
        """Whether a prefetch is still reading one of `keys`."""
        with self._lock:
            return any(k in self._fetching for k in keys)

    def _fetch(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                payload = self._read(key)
            except Exception:  # noqa: BLE001 (an unexpected failure: `load` reads it again, and reports it)
                logger.exception("KV offload: prefetching entry %s failed", key.hex()[:16])
                payload = None
            with self._lock:
                self._fetching.discard(key)
                self._fetched[key] = payload
                self._fetched_bytes += _nbytes(payload)
                while self._fetched_bytes > self.queue_bytes:
                    self._fetched_bytes -= _nbytes(self._fetched.popitem(last=False)[1])

    def _fetch_loop(self) -> None:
        while (keys := self._fetch_queue.get()) is not None:
            self._fetch(keys)

    # -- saves ---------------------------------------------------------------------------------

    def claim(self, key: Key) -> bool:
        """Whether a block of this key should be saved (writes on, not held by every tier, not
        already on its way); a True is answered by exactly one `submit` or `release` (on rank 0;
        under tensor parallelism every rank's store is then given the same save, for its own entry)."""
        with self._lock:
            if not self._writing or key in self._in_flight:
                return False
        if all(tier.contains(k) for tier in self.tiers for k in _shards(key)):
            return False
        with self._lock:
            self._in_flight.add(key)
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether a save of `nbytes` submitted now would be queued (checked before copying a block out)."""
        return self._writing and self._queued_bytes + nbytes <= self.queue_bytes

    def submit(self, key: Key, payload: bytes) -> None:
        """Queue a claimed save of this process's entry of `key`; dropped, never waited for, when the
        queue has no room for it."""
        with self._lock:
            if self._queued_bytes + len(payload) > self.queue_bytes:
                fits = False
            else:
                fits = True
                self._queued_bytes += len(payload)
        if fits:
            self._queue.put_nowait((key, payload))
        else:
            self.release(key, len(payload))

    def release(self, key: Key, nbytes: int = 0) -> None:
        """Give up a claimed save (of `nbytes`, where known) without writing it."""
        with self._lock:
            self._in_flight.discard(key)
            self._writes_dropped += 1
            self._bytes_dropped += nbytes

    def _write_loop(self) -> None:
        _lower_priority()
        reported_at = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=None if self._report is None else REPORT_EVERY_S)
            except queue.Empty:  # idle for a while (only with `report`): report what changed
                item = _IDLE
            if self._report is not None and time.monotonic() - reported_at >= REPORT_EVERY_S:
                reported_at = time.monotonic()
                self._send_report()
            if item is _IDLE:
                continue
            try:
                if item is None:
                    return
                key, payload = item
                try:
                    if self._writing:
                        self._write(self._own(key), payload)
                finally:
                    with self._lock:
                        self._in_flight.discard(key)
                        self._queued_bytes -= len(payload)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, payload: bytes) -> None:
        for tier, counters in zip(self.tiers, self._counters):
            try:  # a tier holding the key already writes nothing (and says so)
                if tier.write(key, payload):
                    counters.writes += 1
                    counters.bytes_written += len(payload)
            except TierFull as e:
                counters.write_failures += 1
                self.stop_writing(f"the {tier.name} tier is full ({e.strerror})")
                return
            except OSError as e:
                counters.write_failures += 1
                self.stop_writing(f"the {tier.name} tier failed a write ({e})")
                return

    def _send_report(self) -> None:
        """Hand `report` the writer's counts if they changed since it was last called (the writer's thread)."""
        counts = self.writer_counts()
        if counts == self._reported:
            return
        try:
            self._report(counts)
        except Exception as e:  # noqa: BLE001 (whoever reads them is gone or unreachable: they stay as last sent)
            logger.warning("KV offload: could not report this rank's writes (%s); its counts stay as last reported",
                           e)
            self._report = None
            return
        self._reported = counts

    def stop_writing(self, why: str) -> None:
        """Turn writes off for good, with one warning saying `why` (what stopped them first is kept in
        `stopped_why`); claims are refused from now on and loads go on."""
        with self._lock:
            if not self._writing:
                return
            self.stopped_why = why  # before writing turns off: a reader seeing it off finds the reason
            self._writing = False
        logger.warning("KV offload: %s; no more blocks are written, cached entries are still read", why)

    @property
    def writing(self) -> bool:
        """Whether writes are on (a tier failing, or `stop_writing`, turns them off for good)."""
        return self._writing

    # -- state ---------------------------------------------------------------------------------

    def writer_counts(self) -> WriterCounts:
        """This process's writes (under tensor parallelism: this rank's alone)."""
        return WriterCounts(tuple(c.writes for c in self._counters), tuple(c.bytes_written for c in self._counters),
                            tuple(c.write_failures for c in self._counters), self._writes_dropped,
                            self._bytes_dropped)

    def stats(self) -> OffloadStats:
        """The tiers' counters; writes (and failed and dropped ones) are this process's and, on rank 0 under
        tensor parallelism, every other rank's as it last reported them (`peers`: within about a second)."""
        counts = [self.writer_counts(), *(self.peers() if self.peers is not None else ())]
        tiers = tuple(TierStats(t.name, c.hits, c.load_failures, c.bytes_loaded, c.load_seconds,
                                sum(n.writes[i] for n in counts), sum(n.bytes_written[i] for n in counts),
                                sum(n.write_failures[i] for n in counts), *t.usage())
                      for i, (t, c) in enumerate(zip(self.tiers, self._counters)))
        return OffloadStats(tiers, sum(n.writes_dropped for n in counts), sum(n.bytes_dropped for n in counts),
                            self._queued_bytes, self.queue_bytes, self._writing)

    def flush(self) -> None:
        """Wait until every save queued so far is written (tests, benchmarks)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop and join the writer (and the loader), and close the tiers.
        Idempotent."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self._loader is not None and self._loader.is_alive():
            self._fetch_queue.put(None)
            self._loader.join()
        with self._lock:
            self._fetched.clear()
            self._fetched_bytes = 0
        for tier in self.tiers:
            tier.close()

    def is_idle(self) -> bool:
        """No save claimed and still unwritten (C2: every claim is answered)."""
        with self._lock:
            return not self._in_flight


def _lower_priority() -> None:
    """Make the calling thread run on CPU time the engine's threads leave: Linux's SCHED_IDLE (the thread's
    own policy), else nice +WRITER_NICENESS. A niced thread still takes its weight's share (about a tenth
    at +10) of the CPU time the scheduler gives this process, which on cores other processes keep busy
    comes out of the step's thread; an idle-policy one takes next to none while the step's thread runs."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        return
    except (AttributeError, OSError):
        pass
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICENESS))
