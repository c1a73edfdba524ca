"""The disk tier's writer: a process of its own, fed through shared memory, so that checksumming and
writing a block never contends with the engine's threads for the interpreter's lock.

    engine process (the step's thread)                  writer process (SCHED_IDLE)
    reserve(n)   room in the ring? a slice of it  ┐
    (the caller copies the block into the slice)  │ ring: shared memory (memfd, no name in any file system)
    commit(key)  (offset, length, key) ──────────►├──── requests pipe ──► DiskTier.write (checksum, atomic
    drain()      ◄── one status per block, in order ─── done pipe ◄──────  write, the directory's cap)
    close()      closes the requests pipe ──────────────────────────────► writes what is queued, exits

The ring is bounded: `reserve` answers None when the block does not fit behind the blocks not yet
written (or when the requests pipe is full), so the step never waits. Blocks are written in the order
they were committed; the writer frees a block's pages of the ring once written. A writer whose engine
dies sees its requests pipe end, writes what is queued and exits; an engine whose writer dies sees
its done pipe end (`exited`).
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

from blockserve.kv.tiers.disk import DiskTier, TierFull

REQUEST = struct.Struct("<QQ32s")  # ring offset, length, entry key
DONE = struct.Struct("<BQH")  # status, bytes written, length of the reason that follows
WRITTEN, NOT_WRITTEN, FULL, FAILED, SKIPPED = range(5)  # SKIPPED: writes were off after a failure
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Done:
    """One block's outcome: `status` (WRITTEN, NOT_WRITTEN: held already or larger than the cap, FULL,
    FAILED, SKIPPED), the entry's payload bytes when written, why it failed."""

    status: int
    nbytes: int
    reason: str


class WriterProcess:
    """A writer process for the disk tier at `directory` (cap `capacity_bytes`), fed through a ring of
    `ring_bytes` (rounded up to whole pages). One thread reserves and commits; `drain` may run on any."""

    def __init__(self, directory: str, capacity_bytes: int, ring_bytes: int):
        self.ring_bytes = -(-ring_bytes // PAGE) * PAGE
        memfd = os.memfd_create("blockserve-kv-queue", os.MFD_CLOEXEC)
        requests_read, self._requests = os.pipe2(os.O_CLOEXEC)
        self._done, done_write = os.pipe2(os.O_CLOEXEC)
        try:
            os.ftruncate(memfd, self.ring_bytes)
            self._ring = mmap.mmap(memfd, self.ring_bytes)
            self._view = memoryview(self._ring)
            os.set_blocking(self._requests, False)  # a full pipe is no room, never a wait
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
            self.process = subprocess.Popen(
                [sys.executable, "-c", _MAIN, str(memfd), str(requests_read), str(done_write), directory,
                 str(capacity_bytes)],
                pass_fds=(memfd, requests_read, done_write), stdin=subprocess.DEVNULL, env=env,
                process_group=0)  # no terminal's signals (the engine's session: its scheduling group)
        except BaseException:
            os.close(self._requests)
            os.close(self._done)
            raise
        finally:
            for fd in (memfd, requests_read, done_write):
                os.close(fd)
        os.set_blocking(self._done, False)
        self._head = 0  # where the next block goes: a position in the ring's unwrapped space
        self._ends: deque[int] = deque()  # the unwrapped end of each block committed and not yet done
        self._tail = 0  # the unwrapped end of the last block done (all before it are free)
        self._reserved: tuple[int, int] | None = None  # (unwrapped start, length) handed out, not committed
        self._received = bytearray()
        self.exited = False  # the done pipe ended: the process is gone

    # -- the step's side ----------------------------------------------------------------------

    def _place(self, nbytes: int) -> int | None:
        start = self._head
        if start % self.ring_bytes + nbytes > self.ring_bytes:  # a block is never split: wrap
            start += self.ring_bytes - start % self.ring_bytes
        return start if start + nbytes - self._tail <= self.ring_bytes else None

    def has_room(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` fits behind the blocks not yet written (as last drained)."""
        return not self.exited and self._place(nbytes) is not None

    def reserve(self, nbytes: int) -> memoryview | None:
        """A writable slice of the ring for a block of `nbytes`, None if it does not fit now; the block
        is written once `commit`ted, and forgotten by `cancel`."""
        start = None if self.exited else self._place(nbytes)
        if start is None:
            return None
        self._reserved = (start, nbytes)
        at = start % self.ring_bytes
        return self._view[at : at + nbytes]

    def cancel(self) -> None:
        """Forget the slice `reserve` handed out (its block will not be written)."""
        self._reserved = None

    def commit(self, key: bytes) -> bool:
        """Queue the reserved slice's block for writing under `key`; False (and nothing queued) if the
        requests pipe has no room for it."""
        start, nbytes = self._reserved
        self._reserved = None
        try:
            os.write(self._requests, REQUEST.pack(start % self.ring_bytes, nbytes, key))
        except BlockingIOError:
            return False
        except BrokenPipeError:
            self.exited = True
            return False
        end = start + nbytes
        self._head = -(-end // PAGE) * PAGE  # pages are freed whole once written
        self._ends.append(self._head)
        return True

    @property
    def queued_bytes(self) -> int:
        """The ring's bytes held by blocks not yet written (gaps before a wrap included)."""
        return self._head - self._tail

    @property
    def pending(self) -> int:
        """Blocks committed and not yet reported done."""
        return len(self._ends)

    def drain(self, wait: bool = False) -> list[Done]:
        """The outcomes reported since the last call, in commit order; with `wait`, blocks until at
        least one comes (or the process is gone). The caller serializes calls."""
        if self._done < 0:  # closed: what `close` read last
            return self._parse()
        while True:
            try:
                chunk = os.read(self._done, 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                self.exited = True
            elif chunk:
                self._received += chunk
            done = self._parse()
            if done or not wait or self.exited or not self._ends:
                return done
            select.select([self._done], [], [])

    def _parse(self) -> list[Done]:
        done = []
        while len(self._received) >= DONE.size:
            status, nbytes, length = DONE.unpack_from(self._received)
            if len(self._received) < DONE.size + length:
                break
            reason = bytes(self._received[DONE.size : DONE.size + length]).decode()
            del self._received[: DONE.size + length]
            self._tail = self._ends.popleft()
            done.append(Done(status, nbytes, reason))
        return done

    def close(self) -> None:
        """Let the process write what is queued and exit, and wait for it (`drain` then gives the outcomes
        not drained yet). Idempotent."""
        if self._requests < 0:
            return
        self._reserved = None
        os.close(self._requests)
        self._requests = -1
        os.set_blocking(self._done, True)
        while chunk := os.read(self._done, 1 << 16):
            self._received += chunk
        self.exited = True
        self.process.wait()
        os.close(self._done)
        self._done = -1
        self._view.release()
        self._ring.close()


def _serve(ring: mmap.mmap, requests: int, done: int, tier: DiskTier) -> None:
    """Write each requested block, in order, until the requests pipe ends; report each outcome on `done`
    (on until the engine is gone: then the rest is still written)."""
    view = memoryview(ring)
    writing, reporting = True, True
    with os.fdopen(requests, "rb") as stream:
        while len(message := stream.read(REQUEST.size)) == REQUEST.size:
            offset, nbytes, key = REQUEST.unpack(message)
            status, written, reason = SKIPPED, 0, ""
            if writing:
                try:
                    status, written = (WRITTEN, nbytes) if tier.write(key, view[offset : offset + nbytes]) else (NOT_WRITTEN, 0)
                except TierFull as e:
                    status, reason, writing = FULL, e.strerror or str(e), False
                except OSError as e:
                    status, reason, writing = FAILED, str(e), False
            ring.madvise(mmap.MADV_REMOVE, offset, -(-nbytes // PAGE) * PAGE)  # blocks start on a page
            if reporting:
                encoded = reason.encode()[:4000]
                try:
                    os.write(done, DONE.pack(status, written, len(encoded)) + encoded)
                except BrokenPipeError:
                    reporting = False


def main(argv: list[str]) -> int:
    """The writer process (`_MAIN`, which first lowers its priority to Linux's SCHED_IDLE, else nice 19: it
    runs on CPU time the engine's threads leave; it stays in the engine's session, so where the kernel
    shares CPUs out by session, autogroup, it draws on the engine's share as a thread would)."""
    memfd, requests, done = (int(a) for a in argv[:3])
    directory, capacity_bytes = argv[3], int(argv[4])
    ring = mmap.mmap(memfd, 0)
    os.close(memfd)
    tier = DiskTier(directory, capacity_bytes, register=False)
    try:
        _serve(ring, requests, done, tier)
    finally:
        os.close(done)
    return 0


# The process's priority is lowered before it imports anything: its start-up must not compete with the step either.
_MAIN = """
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from blockserve.kv.tiers.writer_process import main
sys.exit(main(sys.argv[1:]))
"""
